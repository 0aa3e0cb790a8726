"""The skinny GEMM (``custom_ops/skinny_gemm.py``) against cuBLAS and float32, on CUDA.

For 1 to 16 rows, bf16 and fp16, even and ragged ``N`` and ``K`` (the masked paths), and the
shapes of the default model and the Llama-3-8B preset: the kernel's result is within one
rounding of the float32 product, as cuBLAS's is; it writes into ``out`` (a strided row view, as
the piecewise segments pass) and nowhere else; and it replays in a CUDA graph. The same for the
gated variant (a SwiGLU MLP's gate/up projection ending in ``silu(gate) * up``) against the
projection followed by ``silu_and_mul``.

With a programmatic dependent launch (sm90+), a chain of kernels replayed in a graph gives the
same bits as plain launches.

One pytest call on a CUDA host: ``python -m pytest -q tests/gpu/test_skinny_gemm_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from custom_ops import skinny_gemm
from custom_ops.skinny_gemm import (
    gated_silu_reference,
    skinny_gated_silu_launch,
    skinny_linear_launch,
    skinny_linear_triton,
    use_gated_silu,
)
from fastdeploy.model_executor.layers.linear import gated_silu_linear, linear

pytestmark = [
    pytest.mark.skipif(skinny_gemm.triton is None, reason="needs Triton"),
]

# (N, K): SmolLM2-135M's qkv, down and head; Llama-3-8B's qkv, o, gate/up and down; ragged ones.
# (1000, 512) has K a multiple of the tile and N not (the unmasked-K, masked-N loads).
SHAPES = [(960, 576), (576, 1536), (49152, 576), (6144, 4096), (4096, 4096), (28672, 4096),
          (4096, 14336), (1000, 300), (17, 4100), (1000, 512)]  # fmt: skip


def check_close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """``got`` within one rounding of the float32 product, and no further from it than cuBLAS
    is (up to one more rounding)."""
    exact = x.float() @ w.float().t()
    ref = F.linear(x, w)
    eps = torch.finfo(x.dtype).eps
    scale = exact.abs().max().item()
    err = (got.float() - exact).abs().max().item()
    err_ref = (ref.float() - exact).abs().max().item()
    assert err <= scale * eps, (err, scale)
    assert err <= err_ref + scale * eps / 2, (err, err_ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 3, 16])
def test_matches_float32_like_cublas(m: int, n: int, k: int, dtype: torch.dtype):
    g = torch.Generator(device="cuda").manual_seed(n * 31 + k + m)
    x = torch.randn(m, k, device="cuda", dtype=dtype, generator=g)
    w = torch.randn(n, k, device="cuda", dtype=dtype, generator=g) / k**0.5
    check_close(skinny_linear_triton(x, w), x, w)


def check_out_only_and_replay(launch, check, n_weight: int, n_out: int, device="cuda"):
    """``launch(x, w, out)`` with 5 rows of a strided ``x`` and a strided ``out`` (rows of a
    wider persistent buffer, as the QKV buffer of the segments): it returns ``out``, ``check``
    passes, the rest of the buffer keeps its sentinel, and a graph of the launch replays on new
    ``x``. Returns ``(x, w, buffer)``."""
    torch.manual_seed(0)
    m, k = 5, 576
    x = torch.randn(m, k + 40, device=device, dtype=torch.bfloat16)[:, :k]  # rows k + 40 apart
    w = torch.randn(n_weight, k, device=device, dtype=torch.bfloat16) / k**0.5
    buf = torch.full((16, n_out + 24), 7.0, device=device, dtype=torch.bfloat16)
    out = buf[:m, :n_out]
    assert launch(x, w, out) is out
    check(out, x, w)
    assert (buf[:m, n_out:] == 7).all() and (buf[m:] == 7).all()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch(x, w, out)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    check(out, x, w)
    return x, w, buf


def test_writes_out_only_and_replays_in_a_graph():
    check_out_only_and_replay(skinny_linear_triton, check_close, 1000, 1000)


def test_linear_dispatch():
    """``linear`` takes the kernel for up to 16 rows without bias and cuBLAS otherwise; the
    results agree either way."""
    torch.manual_seed(0)
    w = torch.randn(640, 256, device="cuda", dtype=torch.bfloat16) / 16
    b = torch.randn(640, device="cuda", dtype=torch.bfloat16)
    for m in (1, 16, 17, 64):
        x = torch.randn(m, 256, device="cuda", dtype=torch.bfloat16)
        assert skinny_gemm.use_skinny(x, w) == (m <= 16)
        check_close(linear(x, w), x, w)
        # With a bias it is cuBLAS's F.linear itself (the kernel has no bias).
        torch.testing.assert_close(linear(x, w, b), F.linear(x, w, b), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"x \[1..16, K\]"):
        skinny_linear_triton(torch.randn(17, 256, device="cuda", dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="out must be"):
        x = torch.randn(2, 256, device="cuda", dtype=torch.bfloat16)
        skinny_linear_triton(x, w, torch.empty(2, 641, device="cuda", dtype=torch.bfloat16))


# (2I, K) of merged gate/up weights: SmolLM2-135M's, Llama-3-8B's, and ragged ones: I = 1000 is
# not a multiple of a program's 32 output columns, with K = 300 not a multiple of the 128-deep
# tile (masked K and N) and with K = 256 a multiple of it (unmasked K, masked N).
GATED_SHAPES = [(3072, 576), (28672, 4096), (2000, 300), (2000, 256)]


def check_gated_close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """``got`` (``silu(gate) * up``) no further from its float32 value than the unfused path
    (cuBLAS's projection, rounded, then ``silu_and_mul`` rounded again) is, up to one rounding of
    the result and one of each projection."""
    gate, up = (x.float() @ w.float().t()).chunk(2, dim=-1)
    exact = F.silu(gate) * up
    ref = gated_silu_reference(x, w).float()
    eps = torch.finfo(x.dtype).eps
    # A rounding of gate (through silu's slope, at most 1.1 in size), of up and of the result
    # may each go the other way than the unfused path's.
    bound = eps * (1.1 * gate.abs() * up.abs() + F.silu(gate).abs() * up.abs() + exact.abs())
    err = (got.float() - exact).abs()
    err_ref = (ref - exact).abs()
    assert (err <= bound + err_ref).all(), ((err - bound - err_ref).max().item(),)
    assert got.shape == ref.shape and got.dtype == x.dtype


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", GATED_SHAPES)
@pytest.mark.parametrize("m", [1, 3, 16])
def test_gated_silu_matches_projection_then_silu_and_mul(m, n, k, dtype):
    g = torch.Generator(device="cuda").manual_seed(n * 29 + k + m)
    x = torch.randn(m, k, device="cuda", dtype=dtype, generator=g)
    w = torch.randn(n, k, device="cuda", dtype=dtype, generator=g) / k**0.5
    assert use_gated_silu(x, w)
    check_gated_close(skinny_gated_silu_launch(x, w), x, w)
    # The layers' entry point takes the kernel (no silu_and_mul launched) and agrees with it.
    calls = []
    got = gated_silu_linear(x, w, None, lambda t: calls.append(t) or t)
    assert not calls
    torch.testing.assert_close(got, skinny_gated_silu_launch(x, w), rtol=0, atol=0)


def test_gated_silu_writes_out_only_and_replays_in_a_graph():
    launch, check = skinny_gated_silu_launch, check_gated_close
    x, w, buf = check_out_only_and_replay(launch, check, 2000, 1000)
    with pytest.raises(ValueError, match="out must be"):
        skinny_gated_silu_launch(x, w, buf[:5, :1001])
    assert not use_gated_silu(x, w[:-1])  # an odd number of rows is not [gate; up]


@pytest.mark.skipif(
    not torch.cuda.is_available() or not skinny_gemm.pdl_supported(torch.cuda.current_device()),
    reason="programmatic dependent launch needs sm90+ and Triton 3.4+",
)
@pytest.mark.parametrize("rows", [1, 16])
@torch.inference_mode()
def test_pdl_chain_in_a_graph_equals_plain_launches(rows: int):
    # A decode MLP's chain: RMSNorm (flashinfer, a PDL launch on sm90) -> gated gate/up -> down
    # -> a second layer's gated gate/up, each reading the previous kernel's output. With PDL every
    # kernel is launched before its predecessor finished; the results must be bit-identical.
    from fastdeploy.model_executor.layers.normalization import RMSNorm

    torch.manual_seed(0)
    h, inter = 4096, 14336
    x = torch.randn(rows, h, device="cuda", dtype=torch.bfloat16)
    norm = RMSNorm(h, 1e-5, torch.bfloat16).cuda()
    gate_up = [
        torch.randn(2 * inter, h, device="cuda", dtype=torch.bfloat16) / h**0.5 for _ in (0, 1)
    ]
    down = torch.randn(h, inter, device="cuda", dtype=torch.bfloat16) / inter**0.5
    outs = {}
    for pdl in (False, True):
        act = torch.empty(rows, inter, device="cuda", dtype=torch.bfloat16)
        mid = torch.empty(rows, h, device="cuda", dtype=torch.bfloat16)
        last = torch.empty(rows, inter, device="cuda", dtype=torch.bfloat16)

        def chain(pdl=pdl, act=act, mid=mid, last=last):
            skinny_gated_silu_launch(norm(x), gate_up[0], act, pdl=pdl)
            skinny_linear_launch(act, down, mid, pdl=pdl)
            skinny_gated_silu_launch(mid, gate_up[1], last, pdl=pdl)

        chain()  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            chain()
        last.zero_()
        for _ in range(20):
            graph.replay()
        torch.cuda.synchronize()
        outs[pdl] = last.clone()
        check_gated_close(act, norm(x), gate_up[0])
    assert torch.equal(outs[True], outs[False])
