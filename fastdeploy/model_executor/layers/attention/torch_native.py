"""Attention in plain PyTorch: gather each request's KV pages, then run
``scaled_dot_product_attention``.

Correct on CPU and GPU and simple enough to be the numerical reference for the other backends.
It is not fast: one attention call per request per layer, and the KV write synchronises with the
device (see :func:`custom_ops.kv_cache_ops.write_kv_cache`). On GPU the engine uses the
flashinfer backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from custom_ops.kv_cache_ops import write_kv_cache
from fastdeploy.model_executor.layers.attention.backend import AttentionBackend, AttentionBatch


@dataclass(frozen=True)
class RequestSpan:
    """Where one request's rows are in the step.

    Attributes:
        query_start, query_end: its new-token rows of ``q`` (``query_len = end - start``).
        kv_start, kv_end: its rows of the gathered KV (``seq_len = end - start``).
        attn_mask: bool ``[query_len, seq_len]`` (True = attend) when the queries are a proper
            suffix of several tokens; None otherwise.
        is_causal: the queries are the whole sequence (plain causal mask, no offset).
    """

    query_start: int
    query_end: int
    kv_start: int
    kv_end: int
    attn_mask: torch.Tensor | None
    is_causal: bool


@dataclass
class TorchNativeMetadata:
    """What :class:`TorchNativeAttentionBackend` needs for one step, built once per step.

    Attributes:
        slot_mapping: int64 ``[num_tokens_padded]``, where each token's K/V goes (-1: nowhere).
        kv_block_ids: int64 ``[sum(seq_lens)]``, block of every cached token, request after request.
        kv_offsets: int64 ``[sum(seq_lens)]``, row of that token inside its block.
        requests: one :class:`RequestSpan` per request.
    """

    slot_mapping: torch.Tensor
    kv_block_ids: torch.Tensor
    kv_offsets: torch.Tensor
    requests: list[RequestSpan]


def causal_suffix_mask(query_len: int, seq_len: int, device: torch.device) -> torch.Tensor:
    """Bool ``[query_len, seq_len]``: query ``i`` (at position ``seq_len - query_len + i``) sees
    keys ``0 .. seq_len - query_len + i``."""
    mask = torch.ones(query_len, seq_len, dtype=torch.bool, device=device)
    return mask.tril(diagonal=seq_len - query_len)


class TorchNativeAttentionBackend(AttentionBackend):
    """Paged attention with ``torch.nn.functional.scaled_dot_product_attention``.

    Grouped-query heads are handled by SDPA's ``enable_gqa``. See :class:`AttentionBackend` for
    the constructor arguments and shapes.
    """

    name = "torch_native"

    def build_metadata(self, batch: AttentionBatch) -> TorchNativeMetadata:
        """Index tensors and causal masks for ``batch`` (host ints from its ``*_host`` lists).

        Raises:
            ValueError: a request whose query is longer than its sequence.
        """
        device = self.device
        block_tables = batch.block_tables.to(device=device, dtype=torch.int64)
        requests, block_ids, offsets = [], [], []
        query_start = kv_start = 0
        for i in range(batch.num_reqs):
            query_len, seq_len = batch.query_lens_host[i], batch.seq_lens_host[i]
            if query_len > seq_len:
                raise ValueError(f"request {i}: query_len={query_len} > seq_len={seq_len}")
            positions = torch.arange(seq_len, device=device)
            block_ids.append(block_tables[i, positions // self.block_size])
            offsets.append(positions % self.block_size)
            is_causal = query_len == seq_len and query_len > 1
            mask = None
            if 1 < query_len < seq_len:
                mask = causal_suffix_mask(query_len, seq_len, device)
            requests.append(
                RequestSpan(
                    query_start,
                    query_start + query_len,
                    kv_start,
                    kv_start + seq_len,
                    mask,
                    is_causal,
                )
            )
            query_start += query_len
            kv_start += seq_len
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        return TorchNativeMetadata(
            slot_mapping=batch.slot_mapping.to(device=device, dtype=torch.int64),
            kv_block_ids=torch.cat(block_ids) if block_ids else empty,
            kv_offsets=torch.cat(offsets) if offsets else empty,
            requests=requests,
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TorchNativeMetadata,
        out: torch.Tensor | None = None,
        write_kv: bool = True,
    ) -> torch.Tensor:
        """See :meth:`AttentionBackend.forward`; padding rows of the output are zero."""
        out_buffer = out  # piecewise graphs pass the buffer the next segment reads
        if write_kv:
            write_kv_cache(k, v, kv_cache, metadata.slot_mapping)
        num_tokens = q.shape[0]
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        # [sum(seq_lens), num_kv_heads, head_dim], every request's cached K/V in one gather.
        keys = kv_cache[metadata.kv_block_ids, 0, metadata.kv_offsets]
        values = kv_cache[metadata.kv_block_ids, 1, metadata.kv_offsets]
        out = q.new_zeros(num_tokens, self.num_heads, self.head_dim)
        enable_gqa = self.num_heads != self.num_kv_heads
        for r in metadata.requests:
            if r.query_end == r.query_start:
                continue
            # SDPA wants [batch, heads, len, head_dim].
            qi = q[r.query_start : r.query_end].transpose(0, 1).unsqueeze(0)
            ki = keys[r.kv_start : r.kv_end].transpose(0, 1).unsqueeze(0)
            vi = values[r.kv_start : r.kv_end].transpose(0, 1).unsqueeze(0)
            oi = F.scaled_dot_product_attention(
                qi,
                ki,
                vi,
                attn_mask=r.attn_mask,
                is_causal=r.is_causal,
                scale=self.scale,
                enable_gqa=enable_gqa,
            )
            out[r.query_start : r.query_end] = oi[0].transpose(0, 1)
        result = out.reshape(num_tokens, self.num_heads * self.head_dim)
        if out_buffer is not None:
            out_buffer.copy_(result)
            return out_buffer
        return result
