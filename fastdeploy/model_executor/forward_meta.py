"""Per-step state that travels through one forward pass."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from fastdeploy.model_executor.layers.attention.backend import AttentionBackend


@dataclass
class ForwardMeta:
    """Everything one model step needs besides ``input_ids`` and ``positions``.

    Built once per step by the model runner; layers read it, nobody stores it.

    Attributes:
        num_tokens: tokens in this step before padding (the first ``num_tokens`` rows are real).
        num_reqs: requests in this step.
        attn_backend: the attention backend that owns ``attn_metadata``.
        attn_metadata: backend-specific metadata, built once per step (not per layer).
        kv_caches: one tensor per layer, shape ``attn_backend.kv_cache_shape(num_blocks)``.
        is_decode_only: every request adds exactly one token (host-side scheduler data).
        step_use_cudagraph: this step replays a CUDA graph (``full`` or ``piecewise``).
        graph_mode: ``"full"``, ``"piecewise"`` or ``"eager"``.
    """

    num_tokens: int
    num_reqs: int
    attn_backend: AttentionBackend
    attn_metadata: Any
    kv_caches: list[torch.Tensor] = field(default_factory=list)
    is_decode_only: bool = False
    step_use_cudagraph: bool = False
    graph_mode: str = "eager"
