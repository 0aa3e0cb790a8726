"""Which path the elementwise layers take (``fused_ops.use_flashinfer``); the flashinfer kernels
themselves are checked against their references on the GPU (``tests/gpu/test_fused_ops_gpu.py``)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from fastdeploy.model_executor.layers import fused_ops


def test_flashinfer_only_for_cuda_tensors_outside_torch_compile(monkeypatch):
    # The GPU answer without a GPU: a stand-in tensor that says it is on CUDA, fused ops on.
    monkeypatch.setattr(fused_ops, "fused_ops_enabled", lambda: True)
    cuda_x = SimpleNamespace(is_cuda=True, dtype=torch.bfloat16)
    cpu_x = SimpleNamespace(is_cuda=False, dtype=torch.bfloat16)
    assert fused_ops.use_flashinfer(cuda_x) is True
    assert fused_ops.use_flashinfer(SimpleNamespace(is_cuda=True, dtype=torch.float16)) is True
    assert fused_ops.use_flashinfer(cpu_x) is False
    # flashinfer's kernels dispatch on half types only: a float32 model keeps the torch ops
    # (its rmsnorm raised "failed to dispatch data type" for float32 on the H200).
    assert fused_ops.use_flashinfer(SimpleNamespace(is_cuda=True, dtype=torch.float32)) is False
    # graph_opt_level 1/2 compile the segments: dynamo must see the torch reference ops (it
    # failed on the environment variable behind fused_ops_enabled before this rule).
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert fused_ops.use_flashinfer(cuda_x) is False


def test_fused_ops_off_by_environment(monkeypatch):
    fused_ops.reset()
    try:
        monkeypatch.setenv("FD_USE_FUSED_OPS", "0")
        assert fused_ops.fused_ops_enabled() is False
        assert fused_ops.why_not_fused("cuda") == "FD_USE_FUSED_OPS=0"
        assert fused_ops.why_not_fused("cpu") == "device is cpu: torch reference ops"
        monkeypatch.setenv("FD_USE_FUSED_OPS", "1")
        assert "float32" in fused_ops.why_not_fused("cuda", torch.float32)
    finally:
        fused_ops.reset()
