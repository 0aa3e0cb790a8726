"""Greedy sampling's Triton argmax (``custom_ops/argmax_ops.py``) against ``torch.argmax`` on
CUDA: random logits of both default vocabularies at several batch sizes, ties (the first index
wins), rows of ``-inf``, NaN (larger than ``+inf``), strided rows, and a replay in a CUDA graph.

One pytest call on a CUDA host: ``python -m pytest -q tests/gpu/test_argmax_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from custom_ops import argmax_ops
from custom_ops.argmax_ops import CHUNK, argmax_rows, argmax_rows_triton

pytestmark = [
    pytest.mark.skipif(argmax_ops.triton is None, reason="needs Triton"),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("vocab", [49152, 128256, 1, CHUNK, CHUNK + 1, 1000])
@pytest.mark.parametrize("batch", [1, 3, 64])
def test_equals_torch_argmax(batch: int, vocab: int, dtype: torch.dtype):
    g = torch.Generator(device="cuda").manual_seed(batch * 7 + vocab)
    x = torch.randn(batch, vocab, device="cuda", generator=g).to(dtype)
    assert torch.equal(argmax_rows_triton(x), x.argmax(dim=-1))


def test_ties_infinities_nan_and_strides():
    x = torch.zeros(7, 3 * CHUNK + 5, device="cuda", dtype=torch.bfloat16)
    x[0, [7, CHUNK + 3, 2 * CHUNK]] = 5  # a tie across chunks: the first index
    x[1] = float("-inf")  # all -inf: index 0
    x[2, [CHUNK + 9, 2 * CHUNK + 1]] = float("inf")
    x[3, [11, 3 * CHUNK + 2]] = float("nan")  # NaN is the largest; the first one wins
    x[4, -1] = 1  # the last element, in the short last chunk
    x[5] = -1
    x[6, [5, 2 * CHUNK]] = float("inf")  # +inf first, NaN later: NaN is larger
    x[6, 2 * CHUNK + 3] = float("nan")
    got = argmax_rows_triton(x)
    assert got.tolist() == [7, 0, CHUNK + 9, 11, 3 * CHUNK + 4, 0, 2 * CHUNK + 3]
    assert torch.equal(got, x.argmax(dim=-1))
    wide = torch.randn(4, 2 * CHUNK, device="cuda")
    view = wide[:, 100 : 100 + CHUNK + 7]  # rows a stride apart, not contiguous
    assert torch.equal(argmax_rows(view), view.argmax(dim=-1))


def test_replays_in_a_graph_and_rejects_bad_input():
    x = torch.randn(16, 49152, device="cuda", dtype=torch.bfloat16)
    argmax_rows_triton(x)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = argmax_rows_triton(x)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, x.argmax(dim=-1))
    with pytest.raises(ValueError, match=r"\[B, V > 0\]"):
        argmax_rows_triton(x.t())
    with pytest.raises(ValueError, match="int64"):
        argmax_rows_triton(torch.zeros(2, 8, device="cuda", dtype=torch.int64))
