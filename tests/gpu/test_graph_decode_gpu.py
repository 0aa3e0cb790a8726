"""GPU tests of the flashinfer backend's decode CUDA graphs (marker ``gpu``): a graph replayed
after a re-plan equals eager attention and the reference, a bucket re-plans only when its pages
change, and a plan made without flashinfer's Python ``plan()`` equals ``plan()``'s.

Tolerance: bf16 outputs within max abs diff ``TOL = 2e-2`` of the float32 reference and of each
other, for graph replay against eager: their split-KV schedules differ.
"""

import pytest
import torch
from attention_steps import (
    BLOCK,
    DEVICE,
    DTYPE,
    SHAPES,
    TABLE_WIDTH,
    TOL,
    Step,
    assert_cache_clean,
    block_pool,
    build_step,
    make_backend,
    max_diff,
    new_cache,
    reference_attention,
)

from fastdeploy.model_executor.layers.attention.backend import AttentionBatch


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
    planner = backend.graph_decode.planner

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
        assert direct.graph_decode.planner is None
        return
    assert direct.graph_decode.planner is not None and planned.graph_decode.planner is None
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
        # The schedule's arrays in the int workspace, as far as the kernel reads them (flashinfer
        # 0.5.3 DecodePlanInfo: padded batch, two float offsets, then the offsets of request
        # indices, KV tile indices, o_indptr, the block valid mask (split KV only) and the chunk
        # size, then the CUDA-graph and split-KV flags). The scheduler writes the mask for every
        # padded block, o_indptr for each of the bucket's requests and the index arrays for the
        # valid blocks only: the rest of each array, and the gaps between them, are leftovers of
        # the wrapper's uninitialised pinned buffer, which differ between wrappers.
        info = [int(x) for x in ma.wrapper._plan_info]
        padded, (req, tile, o_indptr, mask, chunk) = info[0], info[3:8]
        valid = padded
        regions = [(o_indptr, 4 * (bucket + 1)), (chunk, 4)]
        if info[9]:
            regions.append((mask, padded))
            valid = int(a._int_workspace[mask : mask + padded].sum())
            assert 0 < valid <= padded
        regions += [(req, 4 * valid), (tile, 4 * valid)]
        for offset, nbytes in regions:
            got = a._int_workspace[offset : offset + nbytes]
            assert torch.equal(got, b._int_workspace[offset : offset + nbytes]), (i, offset, info)
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
    assert direct.graph_decode.planner.direct_plans == len(lengths)
