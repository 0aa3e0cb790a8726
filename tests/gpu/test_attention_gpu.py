"""GPU tests of the flashinfer backend and the Triton KV write (marker ``gpu``).

Run on a CUDA host (flashinfer-python installed): ``python3 -m pytest -q -m gpu tests/gpu``.
The first run JIT-compiles flashinfer's kernels (about a minute per head size).

Reference: a plain torch paged attention written here (gather each request's pages from the cache,
then float32 ``scaled_dot_product_attention`` with the causal mask aligned to the end of the
sequence). Tolerance: bf16 outputs within max abs diff ``TOL = 2e-2`` of the float32 reference
(and of each other, for graph replay against eager: their split-KV schedules differ).
"""

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from custom_ops.kv_cache_ops import write_kv_cache_torch, write_kv_cache_triton
from fastdeploy.model_executor.layers.attention.backend import AttentionBatch
from fastdeploy.model_executor.layers.attention.flashinfer_backend import (
    FlashInferAttentionBackend,
    paged_kv_layout,
)

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device (torch.cuda.is_available() is False)", allow_module_level=True)

pytestmark = pytest.mark.gpu

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


# ---------------------------------------------------------------- KV write
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_kv_write_matches_reference(shape):
    torch.manual_seed(0)
    hq, hkv, d = shape
    cache_a = torch.zeros(NUM_BLOCKS, 2, BLOCK, hkv, d, dtype=DTYPE, device=DEVICE)
    cache_a[0] = SENTINEL
    cache_b = cache_a.clone()
    num_tokens, pad = 50, 3
    slots = (torch.randperm((NUM_BLOCKS - 1) * BLOCK)[:num_tokens] + BLOCK).to(DEVICE)
    slots = torch.cat([slots, torch.full((pad,), -1, device=DEVICE)])
    # K/V as the column slices of a fused QKV projection (row-strided views).
    qkv = torch.randn(num_tokens + pad, (hq + 2 * hkv) * d, device=DEVICE).to(DTYPE)
    qkv[num_tokens:] = POISON
    k, v = qkv[:, hq * d : (hq + hkv) * d], qkv[:, (hq + hkv) * d :]
    write_kv_cache_triton(k, v, cache_a, slots)
    write_kv_cache_torch(k, v, cache_b, slots)
    assert torch.equal(cache_a, cache_b)
    assert_cache_clean(cache_a)
    # 3-D inputs and a slot mapping longer than the step (only the first T entries are read).
    k3, v3 = k[:10].reshape(10, hkv, d), v[:10].reshape(10, hkv, d)
    longer = torch.cat([slots[:10], torch.zeros(5, dtype=torch.int64, device=DEVICE)])
    write_kv_cache_triton(k3, v3 * 2, cache_a, longer)
    write_kv_cache_torch(k3, v3 * 2, cache_b, longer)
    assert torch.equal(cache_a, cache_b)
    assert_cache_clean(cache_a)


def test_triton_kv_write_replays_in_cuda_graph():
    hkv, d, rows = 2, 64, 8
    cache = torch.zeros(NUM_BLOCKS, 2, BLOCK, hkv, d, dtype=DTYPE, device=DEVICE)
    cache[0] = SENTINEL
    k, v = (torch.zeros(rows, hkv * d, dtype=DTYPE, device=DEVICE) for _ in range(2))
    slots = torch.full((rows,), -1, dtype=torch.int64, device=DEVICE)
    write_kv_cache_triton(k, v, cache, slots)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        write_kv_cache_triton(k, v, cache, slots)
    expected = cache.clone()
    for step in range(2):
        k.copy_(torch.randn(rows, hkv * d, device=DEVICE))
        v.copy_(torch.randn(rows, hkv * d, device=DEVICE))
        k[-2:] = POISON
        v[-2:] = POISON
        slots.copy_(torch.arange(rows, device=DEVICE) + BLOCK * (1 + 3 * step))
        slots[-2:] = -1
        graph.replay()
        write_kv_cache_torch(k, v, expected, slots)
        torch.cuda.synchronize()
        assert torch.equal(cache, expected)
    assert_cache_clean(cache)


# ---------------------------------------------------------------- flashinfer backend
def test_paged_kv_layout():
    layout = paged_kv_layout([1, 3, 1], [1, 16, 17], BLOCK, 4, num_padding_reqs=2)
    assert layout.kv_indptr.tolist() == [0, 1, 2, 4, 4, 4]
    assert layout.kv_last_page_len.tolist() == [1, 16, 1, 1, 1]
    assert layout.qo_indptr.tolist() == [0, 1, 4, 5, 5, 5]
    assert layout.page_rows.tolist() == [0, 4, 8, 9]
    with pytest.raises(ValueError, match="blocks"):
        paged_kv_layout([1], [5 * BLOCK], BLOCK, 4)


@pytest.mark.parametrize("shape", SHAPES)
def test_prefill_with_cached_prefixes_matches_reference(shape):
    torch.manual_seed(1)
    backend = make_backend(shape)
    cache = new_cache(backend)
    # Fresh prompts, cached prefixes that end mid-block and on a block boundary, a chunk
    # continuation and one-token requests mixed in (so the prefill wrapper runs), 4 padding rows.
    cached, new = [0, 20, 33, 16, 5, 47], [37, 13, 1, 40, 1, 18]
    step = build_step(cache, cached, new, shape, block_pool(1), pad_rows=4)
    assert not step.batch.is_decode_only
    md = backend.build_metadata(step.batch)
    out = backend.forward(step.q, step.k, step.v, cache, md)
    n = step.batch.num_tokens
    assert out.shape == step.q.shape and out.dtype == DTYPE
    assert max_diff(out[:n], reference_attention(step, cache, shape)) < TOL
    assert (out[n:] == 0).all()
    assert_cache_clean(cache)
    # The same metadata serves every layer: a second layer's cache gives its own result.
    cache2 = new_cache(backend)
    step2 = build_step(cache2, cached, new, shape, block_pool(1), pad_rows=4)
    out2 = backend.forward(step2.q, step2.k, step2.v, cache2, md, out=torch.empty_like(out))
    assert max_diff(out2[:n], reference_attention(step2, cache2, shape)) < TOL


@pytest.mark.parametrize("shape", SHAPES)
def test_direct_prefill_plan_equals_flashinfers_plan(shape, monkeypatch):
    """Prefill steps planned without flashinfer's Python plan() (flashinfer_plan) get the
    schedule plan() makes and the same output, bit for bit, and match the reference; the first
    plan goes through plan(), every later one does not."""
    torch.manual_seed(5)
    direct = make_backend(shape)
    monkeypatch.setenv("FD_FLASHINFER_DIRECT_PLAN", "0")
    planned = make_backend(shape)
    assert direct._prefill_planner is not None and planned._prefill_planner is None
    cache = new_cache(direct)
    steps = [([0], [16]), ([0, 20, 33], [37, 13, 1]), ([5, 47, 0, 16], [1, 18, 40, 3]),
             ([300], [16]), ([0], [16])]  # fmt: skip
    for i, (cached, new) in enumerate(steps):
        step = build_step(cache, cached, new, shape, block_pool(10 + i), 2, host_table=True)
        outs = []
        for backend in (direct, planned):
            md = backend.build_metadata(step.batch)
            assert md.wrapper is backend.prefill_wrapper
            outs.append(backend.forward(step.q, step.k, step.v, cache, md))
        assert direct.prefill_wrapper._plan_info == planned.prefill_wrapper._plan_info
        assert torch.equal(outs[0], outs[1]), f"step {i}: {max_diff(outs[0], outs[1])}"
        n = step.batch.num_tokens
        assert max_diff(outs[0][:n], reference_attention(step, cache, shape)) < TOL
        assert_cache_clean(cache)
    assert direct._prefill_planner.direct_plans == len(steps) - 1


@pytest.mark.parametrize("shape", SHAPES)
def test_decode_matches_reference(shape):
    torch.manual_seed(2)
    backend = make_backend(shape)
    cache = new_cache(backend)
    cached = [0, 15, 16, 31, 100, 257]
    step = build_step(cache, cached, [1] * len(cached), shape, block_pool(2))
    assert step.batch.is_decode_only
    md = backend.build_metadata(step.batch)
    assert md.wrapper is backend.decode_wrapper
    out = backend.forward(step.q, step.k, step.v, cache, md)
    assert max_diff(out, reference_attention(step, cache, shape)) < TOL
    assert_cache_clean(cache)


@pytest.mark.parametrize("shape", SHAPES)
def test_decode_cuda_graph_replay_after_replan_equals_eager(shape):
    torch.manual_seed(3)
    hq, hkv, d = shape
    bucket = 8
    backend = make_backend(shape)
    cache = new_cache(backend)
    pool = block_pool(3)
    # The runner's persistent buffers: the graph reads these addresses on every replay.
    q_buf = torch.zeros(bucket, hq * d, dtype=DTYPE, device=DEVICE)
    k_buf = torch.zeros(bucket, hkv * d, dtype=DTYPE, device=DEVICE)
    v_buf = torch.zeros_like(k_buf)
    out_buf = torch.zeros_like(q_buf)
    slot_buf = torch.full((bucket,), -1, dtype=torch.int64, device=DEVICE)

    def load(step: Step) -> None:
        q_buf.copy_(step.q)
        k_buf.copy_(step.k)
        v_buf.copy_(step.v)

    # Capture with a dummy decode step of `bucket` requests (one cached token each).
    dummy = build_step(cache, [1] * bucket, [1] * bucket, shape, pool, slot_buf=slot_buf)
    load(dummy)
    meta = backend.make_graph_decode_metadata(bucket)
    backend.plan_graph_decode(meta, dummy.batch, bucket)
    backend.forward(q_buf, k_buf, v_buf, cache, meta, out=out_buf)  # warm-up outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        backend.forward(q_buf, k_buf, v_buf, cache, meta, out=out_buf)

    # Replay twice, re-planned for steps of other lengths: 5 real requests + 3 padding, then 8.
    for cached in ([3, 16, 40, 77, 130], [2, 9, 17, 64, 65, 200, 31, 300]):
        n = len(cached)
        step = build_step(
            cache, cached, [1] * n, shape, pool, pad_rows=bucket - n, slot_buf=slot_buf
        )
        load(step)
        backend.plan_graph_decode(meta, step.batch, bucket)
        graph.replay()
        graph_out = out_buf[:n].clone()
        assert torch.isfinite(graph_out).all()
        eager_batch = AttentionBatch(**{**vars(step.batch), "slot_mapping": slot_buf[:n]})
        md = backend.build_metadata(eager_batch)
        eager = backend.forward(q_buf[:n], k_buf[:n], v_buf[:n], cache, md)
        assert max_diff(graph_out, eager) < TOL
        assert max_diff(graph_out, reference_attention(step, cache, shape)) < TOL
        assert_cache_clean(cache)

    # Guards: a step larger than the bucket, or slots outside the captured buffer.
    with pytest.raises(ValueError):
        backend.plan_graph_decode(meta, build_step(cache, [1] * 9, [1] * 9, shape, pool).batch, 8)
    other = build_step(cache, [1] * bucket, [1] * bucket, shape, pool)
    with pytest.raises(RuntimeError, match="slot_mapping"):
        backend.plan_graph_decode(meta, other.batch, bucket)


def next_decode_step(prev: Step, shape, pool, slot_buf) -> Step:
    """The decode step after ``prev``: every request adds one token (a new block from ``pool``
    when its last one is full); the batch carries its host block table."""
    hq, hkv, d = shape
    n = len(prev.seq_lens)
    blocks = [list(b) for b in prev.blocks]
    tables = torch.zeros(n, TABLE_WIDTH, dtype=torch.int32)
    slots = []
    for i, pos in enumerate(prev.seq_lens):  # the new token's position
        if pos % BLOCK == 0:
            blocks[i].append(pool.pop())
        tables[i, : len(blocks[i])] = torch.tensor(blocks[i])
        slots.append(blocks[i][pos // BLOCK] * BLOCK + pos % BLOCK)
    slot_buf.fill_(-1)
    slot_buf[:n].copy_(torch.tensor(slots))
    seq_lens = [s + 1 for s in prev.seq_lens]
    rows = slot_buf.shape[0]
    batch = AttentionBatch(
        num_reqs=n,
        num_tokens=n,
        query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=tables.to(DEVICE),
        slot_mapping=slot_buf,
        max_query_len=1,
        max_seq_len=max(seq_lens),
        is_decode_only=True,
        query_lens_host=[1] * n,
        seq_lens_host=seq_lens,
        block_tables_host=tables.numpy(),
    )
    q = torch.randn(rows, hq * d, device=DEVICE).to(DTYPE)
    k = torch.randn(rows, hkv * d, device=DEVICE).to(DTYPE)
    v = torch.randn(rows, hkv * d, device=DEVICE).to(DTYPE)
    return Step(batch, q, k, v, blocks, [1] * n, seq_lens)


@pytest.mark.parametrize("shape", SHAPES)
def test_decode_graph_replans_only_when_pages_change(shape):
    """Successive decode steps of the same requests on the same pages reuse the bucket's plan
    (CUDA-core decode: only each last page's length is copied) and still equal the reference;
    a step that opens a new page, or another bucket planned in between, plans again."""
    torch.manual_seed(5)
    hq, hkv, d = shape
    bucket, n = 4, 3
    backend = make_backend(shape)
    cache = new_cache(backend)
    pool = block_pool(5)
    bufs = [torch.zeros(bucket, w * d, dtype=DTYPE, device=DEVICE) for w in (hq, hkv, hkv, hq)]
    q_buf, k_buf, v_buf, out_buf = bufs
    slot_buf = torch.full((bucket,), -1, dtype=torch.int64, device=DEVICE)
    dummy = build_step(cache, [1] * bucket, [1] * bucket, shape, pool, slot_buf=slot_buf)
    meta = backend.make_graph_decode_metadata(bucket)
    backend.plan_graph_decode(meta, dummy.batch, bucket)
    backend.forward(q_buf, k_buf, v_buf, cache, meta, out=out_buf)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        backend.forward(q_buf, k_buf, v_buf, cache, meta, out=out_buf)
    calls = []
    real_plan = meta.wrapper.plan
    meta.wrapper.plan = lambda *a, **kw: (calls.append(1), real_plan(*a, **kw))[1]
    planner = backend._graph_planner

    def plans() -> int:  # through plan(), or without it (GraphDecodePlanner)
        return len(calls) + (planner.direct_plans if planner is not None else 0)

    # Lengths 13, 20, 40 after the first step: the next steps fill their pages until the
    # first request's 17th token opens one (step 4).
    step = build_step(
        cache, [12, 19, 39], [1] * n, shape, pool, pad_rows=bucket - n, slot_buf=slot_buf
    )
    step.batch.block_tables_host = step.batch.block_tables.cpu().numpy()
    counts = []
    for i in range(6):
        q_buf.copy_(step.q)
        k_buf.copy_(step.k)
        v_buf.copy_(step.v)
        backend.plan_graph_decode(meta, step.batch, bucket)
        counts.append(plans())
        graph.replay()
        got = out_buf[:n].clone()
        assert max_diff(got, reference_attention(step, cache, shape)) < TOL, i
        assert_cache_clean(cache)
        step = next_decode_step(step, shape, pool, slot_buf)
    # plans: step 0 plans; steps 1-3 (same pages) reuse it on the CUDA-core path; step 4
    # opens a page; step 5 reuses again. The tensor-core schedule depends on token counts.
    if backend.use_tensor_cores:
        assert counts == [1, 2, 3, 4, 5, 6], counts
    else:
        assert counts == [1, 1, 1, 1, 2, 2], counts
    # Another bucket planned in between: the shared buffers hold its plan, so this one replans.
    other = backend.make_graph_decode_metadata(2)
    other_slots = torch.full((2,), -1, dtype=torch.int64, device=DEVICE)
    other_step = build_step(cache, [3, 4], [1, 1], shape, pool, slot_buf=other_slots)
    backend.plan_graph_decode(other, other_step.batch, 2)
    before = plans()
    q_buf.copy_(step.q)
    k_buf.copy_(step.k)
    v_buf.copy_(step.v)
    backend.plan_graph_decode(meta, step.batch, bucket)
    assert plans() == before + 1
    graph.replay()
    assert max_diff(out_buf[:n], reference_attention(step, cache, shape)) < TOL


@pytest.mark.parametrize("shape", SHAPES)
def test_direct_graph_decode_plan_equals_flashinfers_plan(shape, monkeypatch):
    """Decode graphs re-planned without flashinfer's Python plan() (GraphDecodePlanner, the
    CUDA-core kernel) get the schedule, the int workspace and the fixed buffers plan() leaves,
    and replay to the same output, bit for bit; the capture's plan goes through plan()."""
    torch.manual_seed(6)
    hq, hkv, d = shape
    bucket = 8
    direct = make_backend(shape)
    monkeypatch.setenv("FD_FLASHINFER_DIRECT_PLAN", "0")
    planned = make_backend(shape)
    if direct.use_tensor_cores:  # the tensor-core decode path always plans through plan()
        assert direct._graph_planner is None
        return
    assert direct._graph_planner is not None and planned._graph_planner is None
    cache = new_cache(direct)
    pool = block_pool(6)
    slot_buf = torch.full((bucket,), -1, dtype=torch.int64, device=DEVICE)
    bufs = [torch.zeros(bucket, w * d, dtype=DTYPE, device=DEVICE) for w in (hq, hkv, hkv)]
    graphs = []
    dummy = build_step(  # with its host block table, as the engine captures
        cache, [1] * bucket, [1] * bucket, shape, pool, slot_buf=slot_buf, host_table=True
    )
    for backend in (direct, planned):
        meta = backend.make_graph_decode_metadata(bucket)
        backend.plan_graph_decode(meta, dummy.batch, bucket)
        out = torch.zeros(bucket, hq * d, dtype=DTYPE, device=DEVICE)
        backend.forward(*bufs, cache, meta, out=out)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            backend.forward(*bufs, cache, meta, out=out)
        graphs.append((backend, meta, graph, out))
    lengths = ([3, 16, 40, 77, 130], [2, 9, 17, 64, 65, 200, 31, 300], [1], [400, 4, 250])
    for i, cached in enumerate(lengths):
        n = len(cached)
        step = build_step(
            cache, cached, [1] * n, shape, pool, pad_rows=bucket - n, slot_buf=slot_buf
        )
        step.batch.block_tables_host = step.batch.block_tables.cpu().numpy()
        for buf, src in zip(bufs, (step.q, step.k, step.v)):
            buf.copy_(src)
        outs = []
        for backend, meta, graph, out in graphs:
            backend.plan_graph_decode(meta, step.batch, bucket)
            graph.replay()
            outs.append(out[:n].clone())
        torch.cuda.synchronize()
        (a, ma, _, _), (b, mb, _, _) = graphs
        assert ma.wrapper._plan_info == mb.wrapper._plan_info, i
        # The schedule's arrays in the int workspace (flashinfer 0.5.3 DecodePlanInfo: padded
        # batch, two float offsets, then the offsets of request indices, KV tile indices,
        # o_indptr, the block valid mask (split KV only) and the chunk size, then the CUDA-graph
        # and split-KV flags); the bytes between them are leftovers of the wrapper's pinned
        # buffer, which differ between wrappers.
        info = [int(x) for x in ma.wrapper._plan_info]
        padded, (req, tile, o_indptr, mask, chunk) = info[0], info[3:8]
        regions = [(req, 4 * padded), (tile, 4 * padded), (o_indptr, 4 * padded + 4), (chunk, 4)]
        if info[9]:
            regions.append((mask, padded))
        for offset, nbytes in regions:
            got = a._int_workspace[offset : offset + nbytes]
            assert torch.equal(got, b._int_workspace[offset : offset + nbytes]), (i, offset)
        pages = ma.wrapper._paged_kv_indptr_buf[-1].item()
        assert pages == mb.wrapper._paged_kv_indptr_buf[-1].item()
        for name in ("_paged_kv_indptr_buf", "_paged_kv_last_page_len_buf"):
            assert torch.equal(getattr(ma.wrapper, name), getattr(mb.wrapper, name)), (i, name)
        assert torch.equal(
            ma.wrapper._paged_kv_indices_buf[:pages], mb.wrapper._paged_kv_indices_buf[:pages]
        )
        assert torch.equal(outs[0], outs[1]), f"step {i}: {max_diff(outs[0], outs[1])}"
        assert max_diff(outs[0], reference_attention(step, cache, shape)) < TOL
        assert_cache_clean(cache)
    assert direct._graph_planner.direct_plans == len(lengths)


# ---------------------------------------------------------------- one step over many layers
@pytest.mark.parametrize("shape", SHAPES)
def test_segment_attention_equals_forward_on_every_layer_and_stream(shape):
    """The piecewise path's per-layer attention (flashinfer_direct.LayerAttention: run() for the
    first layer, then the recorded launch with the shared tensors converted to tvm-ffi tensors
    once) equals backend.forward bit for bit on each layer, and launches on the current
    stream: on a side stream, behind a long kernel and a zeroing of the output, a launch on any
    other stream would be overwritten."""
    from fastdeploy.model_executor.layers.attention.flashinfer_direct import LayerAttention

    torch.manual_seed(7)
    backend = make_backend(shape)
    caches = [new_cache(backend) for _ in range(4)]
    cached, new = [0, 20, 5], [16, 13, 1]
    steps = [build_step(c, cached, new, shape, block_pool(3), pad_rows=3) for c in caches]
    step = steps[0]  # the same blocks and lengths in every layer; the layers' K/V differ
    for s, c in zip(steps, caches):
        write_kv_cache_triton(s.k, s.v, c, s.batch.slot_mapping)
    md = backend.build_metadata(step.batch)
    backend.bind_kv_caches(caches)
    n = step.batch.num_tokens
    want = [backend.forward(step.q, step.k, step.v, c, md, write_kv=False).clone() for c in caches]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    out = torch.empty_like(step.q)
    runs, real_run = [], md.wrapper.run

    def counted_run(*args, **kwargs):
        runs.append(1)
        return real_run(*args, **kwargs)

    md.wrapper.run = counted_run
    try:
        with torch.cuda.stream(side):
            attend = backend.segment_attention(step.q, step.k, step.v, out, md, write_kv=False)
            for i, c in enumerate(caches):
                torch.cuda._sleep(20_000_000)  # keeps the side stream busy past the launch
                out.zero_()
                attend(c)
                got = out.clone()
                torch.cuda.current_stream().synchronize()
                assert torch.equal(got, want[i]), f"layer {i}: {max_diff(got, want[i])}"
    finally:
        del md.wrapper.run
    assert len(runs) == 1  # layer 0 through run(), layers 1-3 launched directly
    assert max_diff(want[1][:n], reference_attention(step, caches[1], shape)) < TOL
    # the direct path was taken, with the shared tensors converted
    import tvm_ffi

    q3 = step.q.view(-1, shape[0], shape[2])[:n]
    layer = LayerAttention(md.wrapper, q3, torch.empty_like(q3))
    layer(backend._kv_views[id(caches[0])][1])
    assert isinstance(layer._launch, tvm_ffi.Function)
    converted = [a for a in layer._args if isinstance(a, tvm_ffi.Tensor)]
    cache_args = [layer._args[i] for i in layer._slots]
    assert len(converted) >= 5 and all(isinstance(a, torch.Tensor) for a in cache_args)
