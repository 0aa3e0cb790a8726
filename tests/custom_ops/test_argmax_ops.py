"""Greedy argmax on the CPU: ``argmax_rows`` is ``torch.argmax`` there (the Triton kernels are
checked against it on the GPU, ``tests/gpu/test_argmax_gpu.py``)."""

import torch

from custom_ops.argmax_ops import argmax_rows


def test_argmax_rows_on_the_cpu_is_torch_argmax():
    x = torch.randn(5, 300)
    x[2, [3, 200]] = 100.0  # a tie: the first index, as torch.argmax
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    assert argmax_rows(x)[2].item() == 3
