"""GPU tests of the flashinfer backend and the Triton KV write (marker ``gpu``); the decode CUDA
graphs' tests are in ``test_graph_decode_gpu.py``, what both share in ``attention_steps.py``.

Run on a CUDA host (flashinfer-python installed): ``python3 -m pytest -q -m gpu tests/gpu``.
The first run JIT-compiles flashinfer's kernels (about a minute per head size).

Reference: a plain torch paged attention (``attention_steps.reference_attention``). Tolerance: bf16
outputs within max abs diff ``TOL = 2e-2`` of the float32 reference.
"""

import pytest
import torch
from attention_steps import (
    BLOCK,
    DEVICE,
    DTYPE,
    NUM_BLOCKS,
    POISON,
    SENTINEL,
    SHAPES,
    TOL,
    assert_cache_clean,
    block_pool,
    build_step,
    make_backend,
    max_diff,
    new_cache,
    reference_attention,
)

from custom_ops.kv_cache_ops import write_kv_cache_torch, write_kv_cache_triton
from fastdeploy.model_executor.layers.attention.flashinfer_backend import paged_kv_layout


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
