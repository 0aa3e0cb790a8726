"""The skinny GEMM (``custom_ops/skinny_gemm.py``) against cuBLAS and float32, on CUDA.

For 1 to 16 rows, bf16 and fp16, even and ragged ``N`` and ``K`` (the masked paths), and the
shapes of the default model and the Llama-3-8B preset: the kernel's result is within one
rounding of the float32 product, as cuBLAS's is; it writes into ``out`` (a strided row view, as
the piecewise segments pass) and nowhere else; and it replays in a CUDA graph.

One pytest call on a CUDA host: ``python -m pytest -q tests/gpu/test_skinny_gemm_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gpu_utils import GPU_ONLY

from custom_ops import skinny_gemm
from custom_ops.skinny_gemm import skinny_linear_triton
from fastdeploy.model_executor.layers.linear import linear

pytestmark = [
    *GPU_ONLY,
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


def test_writes_out_only_and_replays_in_a_graph():
    torch.manual_seed(0)
    m, n, k = 5, 1000, 576
    x = torch.randn(m, k + 40, device="cuda", dtype=torch.bfloat16)[:, :k]  # rows k + 40 apart
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    # A strided out: rows of a wider persistent buffer, as the QKV buffer of the segments.
    buf = torch.full((16, n + 24), 7.0, device="cuda", dtype=torch.bfloat16)
    out = buf[:m, :n]
    assert skinny_linear_triton(x, w, out) is out
    check_close(out, x, w)
    assert (buf[:m, n:] == 7).all() and (buf[m:] == 7).all()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        skinny_linear_triton(x, w, out)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    check_close(out, x, w)


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
