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

    Built once per step by the model runner; layers read it, nobody stores it. It holds only what
    a layer reads: the graph mode and the step's sizes are the runner's business.

    Attributes:
        attn_backend: the attention backend that owns ``attn_metadata``.
        attn_metadata: backend-specific metadata, built once per step (not per layer).
        kv_caches: one tensor per layer, shape ``attn_backend.kv_cache_shape(num_blocks)``.
        layer_events: None, or one event per layer (a ``torch.cuda.Event``) marking that this
            step's host-tier swap-in of that layer's KV landed: the layer makes the device
            stream wait on it before writing or reading its cache (:meth:`kv_store`, or the
            attention when it stores K/V itself; ``swap_in_mode=layerwise``).
        slot_mapping: int64 ``[>= T]``, the step's slot of each token (-1: padding), when the
            layers store K/V in their RoPE kernel (:meth:`kv_store`); None: the attention
            backend stores them.
    """

    attn_backend: AttentionBackend
    attn_metadata: Any
    kv_caches: list[torch.Tensor] = field(default_factory=list)
    layer_events: list | None = None
    slot_mapping: torch.Tensor | None = None

    def kv_store(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(kv_caches[layer_idx], slot_mapping)`` where a layer should store its K/V with its
        RoPE (one fused kernel on CUDA) instead of in the attention, else None (no slot mapping:
        the attention stores them).

        Under a layer-by-layer swap-in (``layer_events``) the device stream first waits on the
        layer's event, so nothing writes or reads that layer's cache before its copy landed;
        the attention then does not wait again (``write_kv=False``). A host hit thus runs the
        same kernels as any other prefill: ``request`` and ``layerwise`` swap-ins give the
        same logits, and the first host hit builds no kernel of its own."""
        if self.slot_mapping is None:
            return None
        if self.layer_events is not None:
            self.layer_events[layer_idx].wait()
        return self.kv_caches[layer_idx], self.slot_mapping
