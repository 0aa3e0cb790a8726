"""The attention layer of a decoder: a thin handle that calls the step's attention backend."""

from __future__ import annotations

import torch
from torch import nn

from fastdeploy.model_executor.forward_meta import ForwardMeta


class Attention(nn.Module):
    """Paged attention of one decoder layer.

    Holds no weights. Its :meth:`forward` is the op that piecewise CUDA graphs run eagerly
    between graph segments (``cudagraph_splitting_ops = ["attention"]``), so it does nothing but
    look up this layer's KV cache and call the backend.

    Args:
        num_heads: query heads.
        num_kv_heads: key/value heads.
        head_dim: size of one head.
        layer_idx: index into ``ForwardMeta.kv_caches``.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, layer_idx: int):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.layer_idx = layer_idx

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        forward_meta: ForwardMeta,
        write_kv: bool = True,
    ) -> torch.Tensor:
        """Write K/V to this layer's cache (unless ``write_kv`` is False: the RoPE kernel
        stored them, see :meth:`ForwardMeta.kv_store`) and attend.

        With ``forward_meta.layer_events`` (a layer-by-layer host-tier swap-in) and
        ``write_kv``, the device stream first waits on this layer's event, so the cache is
        written and read only after its copy landed; earlier layers ran meanwhile and no host
        thread waits. ``write_kv=False`` means the caller stored K/V through
        :meth:`ForwardMeta.kv_store`, which already waited.

        Args:
            q: ``[T, num_heads * head_dim]``; k, v: ``[T, num_kv_heads * head_dim]``.
            forward_meta: the step's state (backend, metadata, KV caches, layer events).

        Returns:
            ``[T, num_heads * head_dim]`` in ``q``'s dtype.
        """
        if write_kv and forward_meta.layer_events is not None:
            forward_meta.layer_events[self.layer_idx].wait()
        return forward_meta.attn_backend.forward(
            q,
            k,
            v,
            forward_meta.kv_caches[self.layer_idx],
            forward_meta.attn_metadata,
            write_kv=write_kv,
        )

    def extra_repr(self) -> str:
        return (
            f"layer_idx={self.layer_idx}, heads={self.num_heads}, kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}"
        )
