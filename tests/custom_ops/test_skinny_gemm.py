"""The skinny GEMM's dispatch on the CPU: which inputs the Triton kernel would take, and that
``linear`` (the layers' matmul) equals ``F.linear`` everywhere the kernel is not used. The
kernel itself is checked on the GPU (``tests/gpu/test_skinny_gemm_gpu.py``)."""

import sys
from types import ModuleType, SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from custom_ops import skinny_gemm
from custom_ops.skinny_gemm import (
    MAX_ROWS,
    gated_silu_reference,
    pdl_supported,
    pick_config,
    pick_gated_config,
    use_gated_silu,
    use_skinny,
)
from fastdeploy.model_executor.layers import linear as linear_mod
from fastdeploy.model_executor.layers.activation import SiluAndMul
from fastdeploy.model_executor.layers.linear import Linear, gated_silu_linear, linear


def test_cpu_tensors_never_take_the_kernel():
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    w = torch.randn(8, 32, dtype=torch.bfloat16)
    assert not use_skinny(x, w)
    torch.testing.assert_close(linear(x, w), F.linear(x, w))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, MAX_ROWS, MAX_ROWS + 1])
def test_linear_equals_f_linear(rows: int, bias: bool):
    torch.manual_seed(rows)
    layer = Linear(24, 10, bias=bias)
    torch.nn.init.normal_(layer.weight)
    if bias:
        torch.nn.init.normal_(layer.bias)
    x = torch.randn(rows, 24)
    want = F.linear(x, layer.weight, layer.bias)
    torch.testing.assert_close(layer(x), want)
    out = torch.empty(rows, 10)
    with torch.no_grad():  # out= has no autograd; the engine runs in inference mode
        assert layer(x, out=out) is out
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(linear(x.unsqueeze(0), layer.weight, layer.bias), want[None])


def test_use_skinny_rejects_what_the_kernel_cannot_take():
    # Too many rows, float32, 3-D: refused whatever the device (CPU tensors here; the CUDA
    # answers are checked in tests/gpu/test_skinny_gemm_gpu.py).
    w = torch.randn(8, 32, dtype=torch.bfloat16)
    for x in (
        torch.randn(MAX_ROWS + 1, 32, dtype=torch.bfloat16),
        torch.randn(2, 32, dtype=torch.float32),
        torch.randn(2, 3, 32, dtype=torch.bfloat16),
    ):
        assert not use_skinny(x, w)


def test_fd_use_skinny_gemm_is_read_once(monkeypatch):
    linear_mod.skinny_gemm_enabled.cache_clear()
    try:
        monkeypatch.setenv("FD_USE_SKINNY_GEMM", "0")
        assert linear_mod.skinny_gemm_enabled() is False
        monkeypatch.setenv("FD_USE_SKINNY_GEMM", "1")
        assert linear_mod.skinny_gemm_enabled() is False  # cached
        linear_mod.skinny_gemm_enabled.cache_clear()
        assert linear_mod.skinny_gemm_enabled() is True
        monkeypatch.setenv("FD_USE_SKINNY_GEMM", "maybe")
        linear_mod.skinny_gemm_enabled.cache_clear()
        with pytest.raises(ValueError, match="FD_USE_SKINNY_GEMM='maybe'"):
            linear_mod.skinny_gemm_enabled()
    finally:
        linear_mod.skinny_gemm_enabled.cache_clear()


def test_fd_skinny_gemm_pdl_is_read_once_per_device_and_needs_sm90(monkeypatch):
    cuda0 = torch.device("cuda", 0)
    linear_mod.skinny_pdl.cache_clear()
    monkeypatch.setattr(linear_mod, "pdl_supported", lambda index: index == 0)
    try:
        monkeypatch.delenv("FD_SKINNY_GEMM_PDL", raising=False)
        assert linear_mod.skinny_pdl(cuda0) is True  # on by default
        linear_mod.skinny_pdl.cache_clear()
        monkeypatch.setenv("FD_SKINNY_GEMM_PDL", "0")
        assert linear_mod.skinny_pdl(cuda0) is False
        monkeypatch.setenv("FD_SKINNY_GEMM_PDL", "1")
        assert linear_mod.skinny_pdl(cuda0) is False  # cached
        linear_mod.skinny_pdl.cache_clear()
        assert linear_mod.skinny_pdl(cuda0) is True
        assert linear_mod.skinny_pdl(torch.device("cuda", 1)) is False  # not sm90 (here)
        monkeypatch.setenv("FD_SKINNY_GEMM_PDL", "maybe")
        linear_mod.skinny_pdl.cache_clear()
        with pytest.raises(ValueError, match="FD_SKINNY_GEMM_PDL='maybe'"):
            linear_mod.skinny_pdl(cuda0)
    finally:
        linear_mod.skinny_pdl.cache_clear()


def stub_triton(monkeypatch, version: str, with_gdc: bool) -> None:
    """A stand-in Triton of ``version`` (CPU CI has none), with or without ``gdc_*``."""
    monkeypatch.setattr(skinny_gemm, "triton", SimpleNamespace(__version__=version))
    cuda = ModuleType("triton.language.extra.cuda")
    if with_gdc:
        cuda.gdc_launch_dependents = cuda.gdc_wait = lambda: None
    for name in ("triton", "triton.language", "triton.language.extra"):
        monkeypatch.setitem(sys.modules, name, ModuleType(name))
    monkeypatch.setitem(sys.modules, "triton.language.extra.cuda", cuda)


@pytest.mark.parametrize(("version", "with_gdc", "capability", "want"), [
    ("3.5.0", True, (9, 0), True),
    ("3.4.0", True, (10, 0), True),
    ("3.5.0", True, (8, 9), False),  # Ada: no griddepcontrol
    ("3.3.1", True, (9, 0), False),  # gdc_* exists, launch_pdl does not
    ("3.5.0", False, (9, 0), False),
])  # fmt: skip
def test_pdl_needs_triton_3_4_and_sm90(monkeypatch, version, with_gdc, capability, want):
    stub_triton(monkeypatch, version, with_gdc)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: capability)
    pdl_supported.cache_clear()
    try:
        assert pdl_supported(0) is want
    finally:
        pdl_supported.cache_clear()


def test_pdl_is_unsupported_without_triton(monkeypatch):
    monkeypatch.setattr(skinny_gemm, "triton", None)
    pdl_supported.cache_clear()
    try:
        assert pdl_supported(0) is False
    finally:
        pdl_supported.cache_clear()


@pytest.mark.parametrize("pdl", [False, True])
def test_layers_forward_the_pdl_switch_to_the_launch(monkeypatch, pdl):
    calls = []

    def launch(kind):
        return lambda x, w, out=None, *, pdl: calls.append((kind, pdl)) or "launched"

    monkeypatch.setattr(linear_mod, "_kernels_allowed", lambda x, bias: True)
    monkeypatch.setattr(linear_mod, "use_skinny", lambda x, w: True)
    monkeypatch.setattr(linear_mod, "use_gated_silu", lambda x, w: True)
    monkeypatch.setattr(linear_mod, "skinny_pdl", lambda device: pdl)
    monkeypatch.setattr(linear_mod, "skinny_linear_launch", launch("plain"))
    monkeypatch.setattr(linear_mod, "skinny_gated_silu_launch", launch("gated"))
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    assert linear(x, w) == "launched"
    assert gated_silu_linear(x, w, None, SiluAndMul()) == "launched"
    assert calls == [("plain", pdl), ("gated", pdl)]


def test_gated_config_is_the_measured_one_or_the_plain_tiling():
    assert pick_gated_config(28672, 4096) == (32, 256, 4, 3)  # Llama-3-8B, from the sweep
    for n, k in [(3072, 576), (2000, 300)]:
        assert pick_gated_config(n, k) == pick_config(n, k)
    assert pick_config(49152, 576) is None and pick_gated_config(49152, 576) is None


def test_gated_silu_on_cpu_is_the_projection_then_the_activation():
    torch.manual_seed(3)
    x = torch.randn(3, 24, dtype=torch.bfloat16)
    w = torch.randn(20, 24, dtype=torch.bfloat16)
    assert not use_gated_silu(x, w)  # CPU: no kernel
    got = gated_silu_linear(x, w, None, SiluAndMul())
    want = SiluAndMul()(F.linear(x, w))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # The reference rounds the projection, then silu(gate) * up in float32, once more.
    gate, up = F.linear(x, w).float().chunk(2, dim=-1)
    torch.testing.assert_close(
        gated_silu_reference(x, w), (F.silu(gate) * up).bfloat16(), rtol=0, atol=0
    )
    bias = torch.randn(20, dtype=torch.bfloat16)
    torch.testing.assert_close(
        gated_silu_linear(x, w, bias, SiluAndMul()), SiluAndMul()(F.linear(x, w, bias))
    )
