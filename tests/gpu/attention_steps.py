"""What the flashinfer GPU tests share (``test_attention_gpu.py``, ``test_graph_decode_gpu.py``):
random steps written into a paged cache (:func:`build_step`), the torch reference attention
(gather each request's pages from the cache, then float32 ``scaled_dot_product_attention`` with
the causal mask aligned to the end of the sequence), a backend of each test shape, and the checks
that no write reached a block it must not. Importing it needs no GPU; using it does.
"""

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from custom_ops.kv_cache_ops import write_kv_cache_torch
from fastdeploy.model_executor.layers.attention.backend import AttentionBatch
from fastdeploy.model_executor.layers.attention.flashinfer_backend import FlashInferAttentionBackend

DEVICE = torch.device("cuda")
DTYPE = torch.bfloat16
BLOCK, NUM_BLOCKS, TABLE_WIDTH = 16, 128, 32
TOL = 2e-2
SENTINEL, POISON = 512.0, -384.0  # exact in bf16; POISON marks padding rows' K/V
# (num_heads, num_kv_heads, head_dim): SmolLM2-135M (GQA 3, CUDA-core decode), a GQA-8 shape and
# Llama-3-8B's GQA 4 (both tensor-core decode).
SHAPES = [(9, 3, 64), (16, 2, 128), (32, 8, 128)]


@dataclass
class Step:
    """One step's inputs and what the reference needs: each request's blocks and lengths."""

    batch: AttentionBatch
    q: torch.Tensor  # [T, Hq*D]
    k: torch.Tensor  # [T, Hkv*D]
    v: torch.Tensor
    blocks: list[list[int]]
    query_lens: list[int]
    seq_lens: list[int]


def build_step(
    cache, cached_lens, new_lens, shape, pool, pad_rows=0, slot_buf=None, host_table=False
) -> Step:
    """Write random cached prefixes into ``cache`` (torch reference) and return the step that
    adds ``new_lens`` tokens; blocks are taken from ``pool`` (a list, consumed). ``host_table``
    also gives the batch its host block table, as the engine does."""
    hq, hkv, d = shape
    blocks, slots, tables = [], [], torch.zeros(len(new_lens), TABLE_WIDTH, dtype=torch.int32)
    for i, (c, n) in enumerate(zip(cached_lens, new_lens)):
        req_blocks = [pool.pop() for _ in range(-(-(c + n) // BLOCK))]
        blocks.append(req_blocks)
        tables[i, : len(req_blocks)] = torch.tensor(req_blocks)
        pos = torch.arange(c + n)
        req_slots = torch.tensor(req_blocks)[pos // BLOCK] * BLOCK + pos % BLOCK
        if c:
            kv = torch.randn(2, c, hkv, d, device=DEVICE).to(DTYPE)
            write_kv_cache_torch(kv[0], kv[1], cache, req_slots[:c].to(DEVICE))
        slots.append(req_slots[c:])
    num_tokens = sum(new_lens)
    rows = num_tokens + pad_rows
    slot_mapping = torch.cat([*slots, torch.full((pad_rows,), -1)]).to(DEVICE)
    if slot_buf is not None:
        slot_buf.copy_(slot_mapping)
        slot_mapping = slot_buf
    q = torch.randn(rows, hq * d, device=DEVICE).to(DTYPE)
    k = torch.randn(rows, hkv * d, device=DEVICE).to(DTYPE)
    v = torch.randn(rows, hkv * d, device=DEVICE).to(DTYPE)
    k[num_tokens:] = POISON
    v[num_tokens:] = POISON
    seq_lens = [c + n for c, n in zip(cached_lens, new_lens)]
    cu = torch.zeros(len(new_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(new_lens).cumsum(0)
    batch = AttentionBatch(
        num_reqs=len(new_lens),
        num_tokens=num_tokens,
        query_start_loc=cu.to(DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=tables.to(DEVICE),
        slot_mapping=slot_mapping,
        max_query_len=max(new_lens),
        max_seq_len=max(seq_lens),
        is_decode_only=all(n == 1 for n in new_lens),
        query_lens_host=list(new_lens),
        seq_lens_host=seq_lens,
        block_tables_host=tables.numpy() if host_table else None,
    )
    return Step(batch, q, k, v, blocks, list(new_lens), seq_lens)


def reference_attention(step: Step, cache: torch.Tensor, shape) -> torch.Tensor:
    """float32 ``[num_tokens, Hq*D]``: pages gathered from ``cache``, causal SDPA per request."""
    hq, hkv, d = shape
    q = step.q.float().view(-1, hq, d)
    outs, start = [], 0
    for blocks, qlen, slen in zip(step.blocks, step.query_lens, step.seq_lens):
        pages = cache[torch.tensor(blocks, device=DEVICE)].float()  # [P, 2, BLOCK, hkv, d]
        k = pages[:, 0].reshape(-1, hkv, d)[:slen].transpose(0, 1)[None]
        v = pages[:, 1].reshape(-1, hkv, d)[:slen].transpose(0, 1)[None]
        qi = q[start : start + qlen].transpose(0, 1)[None]
        mask = torch.ones(qlen, slen, dtype=torch.bool, device=DEVICE).tril(slen - qlen)
        o = F.scaled_dot_product_attention(
            qi, k, v, attn_mask=mask, scale=d**-0.5, enable_gqa=hq != hkv
        )
        outs.append(o[0].transpose(0, 1).reshape(qlen, hq * d))
        start += qlen
    return torch.cat(outs)


def new_cache(backend) -> torch.Tensor:
    cache = torch.zeros(backend.kv_cache_shape(NUM_BLOCKS), dtype=DTYPE, device=DEVICE)
    cache[0] = SENTINEL  # block 0 is never handed out: nothing may write it
    return cache


def block_pool(seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randperm(NUM_BLOCKS - 1, generator=g) + 1).tolist()


def make_backend(shape) -> FlashInferAttentionBackend:
    pytest.importorskip("flashinfer")
    hq, hkv, d = shape
    return FlashInferAttentionBackend(
        hq, hkv, d, BLOCK, DTYPE, DEVICE, max_num_reqs=16, max_num_blocks=16 * TABLE_WIDTH
    )


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def assert_cache_clean(cache: torch.Tensor) -> None:
    assert (cache[0] == SENTINEL).all(), "a write reached the untargeted sentinel block"
    assert not (cache == POISON).any(), "a padding row (slot -1) wrote into the cache"
