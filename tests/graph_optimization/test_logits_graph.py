"""The sampled-row logits graphs on CPU: what one computes (run eagerly, as its capture records
it), and which bucket ``CudaGraphRunner.sampled_logits`` replays. Capture and replay themselves
need CUDA (tests/gpu/test_cuda_graphs_gpu.py)."""

import pytest
import torch

from fastdeploy.model_executor.graph_optimization.graph_runner import CudaGraphRunner
from fastdeploy.model_executor.graph_optimization.logits_graph import SampledLogitsGraph


def tail(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = hidden @ torch.arange(12.0).reshape(3, 4)  # [rows, 3] x [3, 4]: 4 "tokens"
    return logits, logits.argmax(-1)


def test_the_rows_logits_indices_name_in_order_with_stale_entries_clamped():
    hidden = torch.randn(10, 3)
    indices = torch.tensor([9, 3, 0, 10**9, -5])  # 3 sampled rows, then stale padding
    graph = SampledLogitsGraph(5, hidden, indices, tail)
    logits, argmax = graph.run_eager()
    want, _ = tail(hidden[[9, 3, 0, 9, 0]])
    assert torch.equal(logits, want) and torch.equal(argmax, want.argmax(-1))
    with pytest.raises(ValueError, match=r"logits_indices \(4,\) for 5 rows"):
        SampledLogitsGraph(5, hidden, indices[:4], tail)


class Replayed:
    def __init__(self, rows: int) -> None:
        self.rows, self.replays = rows, 0

    def replay(self):
        self.replays += 1
        return ("output of", self.rows)


def test_the_smallest_bucket_that_holds_the_sampled_rows_replays():
    graphs = object.__new__(CudaGraphRunner)  # no CUDA pool or stream: only the choice
    graphs.sampled = {}
    graphs._sampled_sizes = []
    assert graphs.sampled_logits(1) is None  # none captured
    graphs.sampled = {b: Replayed(b) for b in (8, 4, 2, 1)}
    graphs._sampled_sizes = sorted(graphs.sampled)
    picks = {n: graphs.sampled_logits(n) for n in (1, 2, 3, 4, 5, 8)}
    assert picks == {n: ("output of", b) for n, b in ((1, 1), (2, 2), (3, 4), (4, 4), (5, 8),
                                                     (8, 8))}  # fmt: skip
    assert graphs.sampled_logits(9) is None  # more rows than the largest bucket
    assert [graphs.sampled[b].replays for b in (1, 2, 4, 8)] == [1, 1, 2, 2]
