"""The LM head and argmax of a piecewise step's sampled rows, captured per row bucket.

A decode graph ends with its rows' logits and their argmax (``CudaGraphRunner``'s
``capture_logits``). A piecewise (prefill or mixed) step ends at the hidden states of all its
tokens, of which only the sampled rows (each request's last prompt token or decode token) become
logits. Run eagerly, that gather, the LM head GEMM and the argmax are three launches and their
Python, 0.25-0.3 ms of host time a mixed step on an H200 host (step trace, 2026-12-02). Here they
are one graph per bucket of sampled rows: it gathers the rows named by the runner's persistent
``logits_indices`` buffer from the shared segment buffer, so one capture serves every step whose
sampled-row count fits the bucket, whatever its token bucket.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fastdeploy.model_executor.graph_optimization.piecewise import capture_graph

Tail = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class SampledLogitsGraph:
    """The sampled rows' logits and argmax for up to ``rows`` rows, as one graph.

    Args:
        rows: the bucket (sampled rows).
        hidden: the segment buffer the last piecewise segment writes, ``[max_tokens, H]`` of the
            model dtype (``SegmentBuffers.hidden``; every token bucket's hidden states are its
            first rows).
        logits_indices: int64 ``[rows]`` view of the runner's persistent buffer of sampled rows;
            entries past a step's sampled rows are stale or zero. They are clamped into
            ``hidden`` (a stale index of an eager step larger than every bucket would read
            past it), and their logits are padding.
        tail: hidden rows ``[rows, H]`` -> ``(logits [rows, vocab], argmax int64 [rows])``
            (``CudaGraphRunner._logits_tail``: the logits into the buffer the decode graphs
            share).
    """

    def __init__(
        self, rows: int, hidden: torch.Tensor, logits_indices: torch.Tensor, tail: Tail
    ) -> None:
        if logits_indices.shape != (rows,):
            raise ValueError(f"logits_indices {tuple(logits_indices.shape)} for {rows} rows")
        self.rows = rows
        self.hidden = hidden
        self.logits_indices = logits_indices
        self.tail = tail
        self.graph: torch.cuda.CUDAGraph | None = None
        #: ``(logits [rows, vocab], argmax int64 [rows])`` the captured graph writes.
        self.output: tuple[torch.Tensor, torch.Tensor] | None = None

    def run_eager(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The captured computation, eagerly (warm-up, and a reference in tests)."""
        index = self.logits_indices.clamp(0, self.hidden.shape[0] - 1)
        return self.tail(self.hidden.index_select(0, index))

    def capture(self, pool, stream: torch.cuda.Stream) -> None:
        """Capture :meth:`run_eager` into one graph in ``pool`` on ``stream``."""

        def forward() -> None:
            self.output = self.run_eager()

        self.graph = capture_graph(forward, pool, stream)

    def replay(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay; returns :attr:`output` (static tensors: consume them before the next step)."""
        self.graph.replay()
        return self.output
