"""The attention backend interface: one small class per kernel library.

A backend owns its metadata (built once per step from :class:`AttentionBatch`) and the KV cache
layout. Layers call :meth:`AttentionBackend.forward` once per layer; that call is where
piecewise CUDA
graphs split, so it must not depend on anything but the step's metadata and its arguments.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass
class AttentionBatch:
    """Host-side description of one step, built by the model runner (no device sync needed).

    Requests are ordered as the runner lays out tokens: request ``i`` owns token rows
    ``query_start_loc[i]:query_start_loc[i+1]``.

    Attributes:
        num_reqs: requests in the step.
        num_tokens: real tokens in the step (padding excluded).
        query_start_loc: int32 ``[num_reqs + 1]``, cumulative new-token counts (starts at 0).
        seq_lens: int32 ``[num_reqs]``, KV length of each request after this step's tokens.
        block_tables: int32 ``[num_reqs, max_blocks_per_seq]``, KV block ids; unused entries 0.
        slot_mapping: int64 ``[num_tokens_padded]``, ``block_id * block_size + offset`` of each
            token's KV; -1 for padding rows, which write nothing.
        max_query_len / max_seq_len: maxima of the two (host ints).
        is_decode_only: every request adds exactly one token.
        query_lens_host / seq_lens_host: the same lengths as Python lists, for planning
            without a device sync.
        block_tables_host: optional int32 numpy ``[num_reqs, max_blocks_per_seq]``, the same
            block table on the host (a view of the runner's pinned set, valid until the second
            ``InputBuffers.prepare`` after this step's): a backend can then read page ids
            without a device gather.
    """

    num_reqs: int
    num_tokens: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    is_decode_only: bool
    query_lens_host: list[int]
    seq_lens_host: list[int]
    block_tables_host: np.ndarray | None = None


class AttentionBackend(ABC):
    """Paged attention with a KV cache per layer.

    Args:
        num_heads: query heads (per tensor-parallel rank).
        num_kv_heads: key/value heads (grouped-query attention when fewer than ``num_heads``).
        head_dim: size of one head.
        block_size: tokens per KV block.
        dtype: activation and KV dtype.
        device: where tensors live.
    """

    name: str = "abstract"
    #: True when :meth:`make_graph_decode_metadata` / :meth:`plan_graph_decode` are implemented,
    #: i.e. a whole decode step including attention can be captured in one CUDA graph.
    supports_graph_decode: bool = False

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.dtype = dtype
        self.device = torch.device(device)
        self.scale = head_dim**-0.5

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of one layer's KV cache: ``[num_blocks, 2, block_size, num_kv_heads, head_dim]``
        (flashinfer's NHD paged layout; index 0 of dim 1 is K, 1 is V)."""
        return (num_blocks, 2, self.block_size, self.num_kv_heads, self.head_dim)

    def bind_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """Called with the worker's per-layer caches once they are allocated, and with ``[]``
        when they are freed: a backend may keep views of them (never past that second call).
        The default keeps nothing."""
        return None

    @abstractmethod
    def build_metadata(self, batch: AttentionBatch) -> Any:
        """Turn the step's batch into backend metadata, once per step."""

    def make_graph_decode_metadata(self, batch_size: int) -> Any:
        """Prepare for capture: metadata bound to fixed-size buffers for a decode bucket of
        ``batch_size`` requests, to be captured inside a full CUDA graph."""
        raise NotImplementedError(f"{self.name} cannot capture decode attention in a CUDA graph")

    def plan_graph_decode(self, graph_metadata: Any, batch: AttentionBatch, batch_size: int) -> Any:
        """Prepare for replay: re-plan ``graph_metadata`` (from :meth:`make_graph_decode_metadata`)
        in place for this step's requests, padded to ``batch_size`` requests; returns it."""
        raise NotImplementedError(f"{self.name} cannot capture decode attention in a CUDA graph")

    def segment_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        metadata: Any,
        write_kv: bool,
    ) -> Callable[[torch.Tensor], None]:
        """One step's attention between piecewise segments, as a function of a layer's cache
        that writes into ``out``: the same buffers serve every layer, so what does not depend on
        the layer (views, checks, zeroing padding rows) can be done here once per step instead
        of once per layer. Arguments as :meth:`forward`; ``out`` is required. The default calls
        :meth:`forward` per layer."""

        def attend(kv_cache: torch.Tensor) -> None:
            result = self.forward(q, k, v, kv_cache, metadata, out=out, write_kv=write_kv)
            if result.data_ptr() != out.data_ptr():
                out.copy_(result)

        return attend

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: Any,
        out: torch.Tensor | None = None,
        write_kv: bool = True,
    ) -> torch.Tensor:
        """Write this step's K/V through the slot mapping, then attend.

        Args:
            q: ``[T, num_heads * head_dim]``; k, v: ``[T, num_kv_heads * head_dim]``; rows past
                the batch's real tokens are padding (their slot is -1, their output is garbage).
            kv_cache: this layer's cache, shape :meth:`kv_cache_shape`.
            metadata: what :meth:`build_metadata` returned for this step.
            out: optional ``[T, num_heads * head_dim]`` tensor to write the result into (piecewise
                graphs pass the buffer the next segment was captured reading).
            write_kv: False when this step's K/V are already in the cache (the layer's RoPE
                kernel stored them: ``ForwardMeta.kv_store``, and the piecewise segments).

        Returns:
            ``[T, num_heads * head_dim]``, causal attention over each request's cached and new
            tokens, scaled by ``head_dim ** -0.5``.
        """
