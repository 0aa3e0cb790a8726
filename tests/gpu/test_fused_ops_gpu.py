"""flashinfer's fused elementwise ops against the torch references the layers keep for the CPU.

RMSNorm, fused add + RMSNorm, RoPE (full and partial rotary, q/k as strided views of a merged
q/k/v output, as the decoder passes them) and SiLU-and-multiply, in bf16 on CUDA: each fused op
is compared with its layer's ``forward_native`` on the same input, and with a float32 evaluation
of the same formula (the fused ops round once, at the end; the references round after every op,
so the fused output is at least as close to float32). Then a whole SmolLM2-shaped model: the
logits with fused ops on and off agree within the graph tolerance, and the fused decode step
launches at most a third of the unfused step's kernels.

One pytest call on a CUDA host with flashinfer:
``python -m pytest -q -s tests/gpu/test_fused_ops_gpu.py``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from fastdeploy.model_executor.layers import fused_ops
from fastdeploy.model_executor.layers.activation import SiluAndMul
from fastdeploy.model_executor.layers.normalization import RMSNorm
from fastdeploy.model_executor.layers.rotary_embedding import RotaryEmbedding

pytestmark = [
    pytest.mark.skipif(
        fused_ops.why_not_fused("cuda") is not None, reason="needs flashinfer and FD_USE_FUSED_OPS"
    ),
]

BF16 = torch.bfloat16


def bf16_close(fused: torch.Tensor, native: torch.Tensor, exact: torch.Tensor, what: str) -> None:
    """``fused`` rounds the float32 result once: within one bf16 ulp (relative 2^-7, plus a
    floor of 2^-7 of the output's scale for values near zero) of the float32 ``exact``, and no
    further from it than the torch reference ``native`` (which rounds after every op), up to
    half an ulp of the scale."""
    scale = exact.abs().max().item()
    torch.testing.assert_close(
        fused.float(), exact, rtol=2**-7, atol=scale * 2**-7, msg=lambda m: f"{what}: {m}"
    )
    err_fused = (fused.float() - exact).abs().max().item()
    err_native = (native.float() - exact).abs().max().item()
    print(f"{what}: max |fused - fp32| {err_fused:.4g}, |native - fp32| {err_native:.4g}")
    assert err_fused <= err_native + scale * 2**-8, (what, err_fused, err_native)


@pytest.mark.parametrize("tokens,hidden", [(1, 576), (37, 4096), (2048, 576)])
def test_rmsnorm_and_fused_add(tokens: int, hidden: int):
    torch.manual_seed(0)
    norm = RMSNorm(hidden, 1e-5, BF16).cuda()
    norm.weight.data.uniform_(0.5, 1.5)
    x = torch.randn(tokens, hidden, device="cuda", dtype=BF16)
    res = torch.randn(tokens, hidden, device="cuda", dtype=BF16) * 4
    w = norm.weight.float()

    def exact_norm(h: torch.Tensor) -> torch.Tensor:
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * w

    bf16_close(norm(x.clone()), norm.forward_native(x), exact_norm(x.float()), "rmsnorm")

    xf, rf = x.clone(), res.clone()
    out, new_res = norm(xf, rf)
    assert out.data_ptr() == xf.data_ptr() and new_res.data_ptr() == rf.data_ptr()  # in place
    ref_out, ref_res = norm.forward_native(x, res)
    exact_sum = x.float() + res.float()
    # the new residual is the sum rounded to bf16 once: within half an ulp of the float32 sum
    torch.testing.assert_close(new_res.float(), exact_sum, rtol=2**-8, atol=1e-6)
    bf16_close(out, ref_out, exact_norm(exact_sum), "fused_add_rmsnorm")


@pytest.mark.parametrize("rotary_fraction", [1.0, 0.5])
def test_rope_in_place_on_qkv_views(rotary_fraction: float):
    torch.manual_seed(0)
    head_dim, heads, kv_heads, max_pos = 128, 8, 2, 4096
    params = {"rope_type": "default", "rope_theta": 500000.0}
    rope = RotaryEmbedding(
        head_dim, max_pos, params, BF16, rotary_dim=int(head_dim * rotary_fraction)
    ).cuda()
    t = 300
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, device="cuda", dtype=BF16)
    positions = torch.randint(0, max_pos, (t,), device="cuda")
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    ref_q, ref_k = rope.forward_native(positions, q, k)
    # float32 reference: the same formula with float32 inputs and cos/sin
    rope32 = RotaryEmbedding(
        head_dim, max_pos, params, torch.float32, rotary_dim=rope.rotary_dim
    ).cuda()
    ex_q, ex_k = rope32.forward_native(positions, q.float(), k.float())
    v_before = v.clone()
    out_q, out_k = rope(positions, q, k)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()
    assert torch.equal(v, v_before)
    bf16_close(out_q, ref_q, ex_q, f"rope q (rotary {rope.rotary_dim})")
    bf16_close(out_k, ref_k, ex_k, f"rope k (rotary {rope.rotary_dim})")


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,rotary_fraction,tokens",
    [(9, 3, 64, 1.0, 1), (9, 3, 64, 1.0, 300), (32, 8, 128, 1.0, 64), (8, 2, 128, 0.5, 300)],
)
def test_rope_and_kv_write_fused(heads, kv_heads, head_dim, rotary_fraction, tokens):
    """The one-kernel RoPE + KV write (``forward_and_store``) on q/k/v views of a merged QKV
    output: q and k equal flashinfer's in-place RoPE, the cache holds exactly the rotated k and
    the v at each real token's slot, padding rows (slot -1) store nothing, v is untouched."""
    from custom_ops.kv_cache_ops import write_kv_cache_triton

    torch.manual_seed(0)
    max_pos, block_size, num_blocks = 4096, 16, 64
    params = {"rope_type": "default", "rope_theta": 500000.0}
    rope = RotaryEmbedding(
        head_dim, max_pos, params, BF16, rotary_dim=int(head_dim * rotary_fraction)
    ).cuda()
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = torch.randn(tokens, q_size + 2 * kv_size, device="cuda", dtype=BF16)
    positions = torch.randint(0, max_pos, (tokens,), device="cuda")
    slots = torch.randperm(num_blocks * block_size, device="cuda")[:tokens]
    slots[1::7] = -1  # padding rows
    shape = (num_blocks, 2, block_size, kv_heads, head_dim)
    want_cache = torch.full(shape, 7.0, device="cuda", dtype=BF16)
    cache = want_cache.clone()
    want = qkv.clone()
    wq, wk, wv = want.split([q_size, kv_size, kv_size], dim=-1)
    rope(positions, wq, wk)  # flashinfer's kernel, in place
    write_kv_cache_triton(wk, wv, want_cache, slots)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    out_q, out_k = rope.forward_and_store(positions, q, k, v, cache, slots)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()
    diff_q = (q.float() - wq.float()).abs().max().item()
    diff_k = (k.float() - wk.float()).abs().max().item()
    print(f"fused rope+kv vs flashinfer rope: max |dq| {diff_q:.3g}, |dk| {diff_k:.3g}")
    # Same float32 formula, one rounding: equal up to one bf16 ulp where FMA contraction differs.
    torch.testing.assert_close(q, wq, rtol=2**-7, atol=2**-7)
    torch.testing.assert_close(k, wk, rtol=2**-7, atol=2**-7)
    assert torch.equal(v, wv)
    # The cache holds exactly this kernel's own k (and v) at each real token's slot, and the
    # sentinel everywhere else.
    exact = want_cache.clone()
    write_kv_cache_triton(k, v, exact, slots)
    assert torch.equal(cache, exact)
    torch.testing.assert_close(cache, want_cache, rtol=2**-7, atol=2**-7)
    assert int((cache == 7.0).all(-1).all(-1).sum()) >= num_blocks * 2 * block_size - 2 * tokens


@pytest.mark.parametrize("tokens", [1, 16])
@torch.inference_mode()
def test_rope_kv_pdl_chain_in_a_graph_equals_plain_launches(tokens: int):
    """The decode chain around the RoPE + KV-write kernel, replayed from a CUDA graph: QKV
    projection (skinny GEMM) -> RoPE + KV write -> a projection of the rotated q, each reading
    the previous kernel's output. With programmatic dependent launches (sm90+) every kernel is
    launched before its predecessor finished; q, the cache and the last output must be
    bit-identical to plain launches, and to the unfused path."""
    from custom_ops import skinny_gemm
    from custom_ops.rope_kv_ops import rope_and_write_kv_triton

    if not skinny_gemm.pdl_supported(torch.cuda.current_device()):
        pytest.skip("programmatic dependent launch needs sm90+ and Triton 3.4+")
    torch.manual_seed(0)
    heads, kv_heads, head_dim, hidden = 32, 8, 128, 4096
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    rope = RotaryEmbedding(head_dim, 4096, {"rope_type": "default", "rope_theta": 5e5}, BF16)
    rope = rope.cuda()
    x = torch.randn(tokens, hidden, device="cuda", dtype=BF16)
    w_qkv = torch.randn(q_size + 2 * kv_size, hidden, device="cuda", dtype=BF16) / hidden**0.5
    w_o = torch.randn(hidden, q_size, device="cuda", dtype=BF16) / q_size**0.5
    positions = torch.arange(100, 100 + tokens, device="cuda")
    slots = torch.arange(40, 40 + tokens, device="cuda")
    results = {}
    for pdl in (False, True):
        qkv = torch.empty(tokens, q_size + 2 * kv_size, device="cuda", dtype=BF16)
        out = torch.empty(tokens, hidden, device="cuda", dtype=BF16)
        cache = torch.zeros(8, 2, 16, kv_heads, head_dim, device="cuda", dtype=BF16)

        def chain(pdl=pdl, qkv=qkv, out=out, cache=cache):
            skinny_gemm.skinny_linear_launch(x, w_qkv, qkv, pdl=pdl)
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            rope_and_write_kv_triton(
                positions, q, k, v, head_dim, rope.cos_sin_cache, cache, slots, pdl=pdl
            )
            skinny_gemm.skinny_linear_launch(q, w_o, out, pdl=pdl)

        chain()  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            chain()
        for _ in range(20):
            cache.zero_()
            graph.replay()
        torch.cuda.synchronize()
        results[pdl] = (qkv.clone(), cache.clone(), out.clone())
    for plain, chained in zip(results[False], results[True]):
        assert torch.equal(plain, chained)
    # And the same values as the unfused kernels, launched plainly, from the same projection.
    want = torch.nn.functional.linear(x, w_qkv)
    wq, wk, wv = want.split([q_size, kv_size, kv_size], dim=-1)
    rope(positions, wq, wk)
    qkv, cache, _ = results[True]
    torch.testing.assert_close(qkv, want, rtol=2**-6, atol=2**-6)
    blocks, offsets = slots // 16, slots % 16
    torch.testing.assert_close(
        cache[blocks, 0, offsets], wk.view(tokens, kv_heads, head_dim), rtol=2**-6, atol=2**-6
    )
    v_rows = qkv[:, q_size + kv_size :].reshape(tokens, kv_heads, head_dim)
    assert torch.equal(cache[blocks, 1, offsets], v_rows)
    cache[blocks, :, offsets] = 0
    assert not cache.any()  # nothing written outside the step's slots


@pytest.mark.parametrize("tokens,inter", [(1, 1536), (513, 14336)])
def test_silu_and_mul(tokens: int, inter: int):
    torch.manual_seed(0)
    x = torch.randn(tokens, 2 * inter, device="cuda", dtype=BF16) * 3
    act = SiluAndMul()
    xf = x.float()
    exact = torch.nn.functional.silu(xf[:, :inter]) * xf[:, inter:]
    bf16_close(act(x), act.forward_native(x), exact, "silu_and_mul")


def _kernel_count():
    """``benchmarks/benchmark_prefill.py``'s profiler kernel counter."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "benchmark_prefill.py"
    spec = importlib.util.spec_from_file_location("benchmark_prefill", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.kernel_count


@torch.inference_mode()
def forward_logits(llm) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 logits of the last token of a 64-token prefill and of each request of a batch-16
    decode step (32 tokens of context), eagerly, random token ids (seeded)."""
    from fastdeploy.worker.input_batch import dummy_step

    runner = llm.engine.worker.runner
    block = runner.buffers.block_size
    out = []
    for sched in (dummy_step([64], block), dummy_step([1] * 16, block, history=32)):
        g = torch.Generator().manual_seed(0)
        for s in sched.scheduled:
            n = s.request.num_prompt_tokens
            s.request.prompt_token_ids = torch.randint(10, 40000, (n,), generator=g).tolist()
        hidden, inputs, _ = runner.forward(sched)
        out.append(runner.model.compute_logits(hidden[inputs.logits_indices]))
    return out[0], out[1]


def decode_kernel_counts(llm) -> int:
    """Kernels of one eager decode step at batch 1 (inputs, forward, logits, greedy sampling)."""
    from fastdeploy.worker.input_batch import dummy_step

    runner = llm.engine.worker.runner
    sched = dummy_step([1], runner.buffers.block_size, history=31)
    return _kernel_count()(lambda: runner.execute_model(sched))


def test_model_fused_vs_unfused(tmp_path_factory, monkeypatch):
    """SmolLM2-135M shape, bf16, dummy weights: the last-token logits of a 64-token prefill and
    of a batch-16 decode step, fused ops on vs off, and the decode step's kernel counts."""
    from gpu_utils import GRAPH_LOGIT_ATOL, make_llm, preset_dir

    llm = make_llm(
        preset_dir(tmp_path_factory, "smollm2-135m"),
        graph_optimization_config={"use_cudagraph": False},
    )
    try:
        fused_logits = forward_logits(llm)
        fused_kernels = decode_kernel_counts(llm)
        monkeypatch.setenv("FD_USE_FUSED_OPS", "0")
        fused_ops.reset()
        native_logits = forward_logits(llm)
        native_kernels = decode_kernel_counts(llm)
    finally:
        fused_ops.reset()
        llm.engine.shutdown()
    for what, a, b in zip(("prefill", "decode"), fused_logits, native_logits):
        diff = (a - b).abs().max().item()
        print(f"{what} logits fused vs torch ops: max |diff| {diff:.4f}")
        # both round differently from float32: allow twice the graph-vs-eager tolerance
        assert diff <= 4 * GRAPH_LOGIT_ATOL, (what, diff)
        agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
        assert agree >= 0.9, (what, agree)
    print(f"decode step kernels at batch 1: fused {fused_kernels}, torch ops {native_kernels}")
    assert fused_kernels * 3 <= native_kernels, (fused_kernels, native_kernels)
