"""Full CUDA graphs: a whole decode step (attention included) captured per decode bucket."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class FullGraph:
    """One decode bucket of ``batch_size`` one-token requests, captured as a single graph.

    The attention metadata is bound to the backend's fixed-size buffers for this bucket
    (``make_graph_decode_metadata``); before each replay the backend re-plans those buffers for the
    step's real requests, padded to ``batch_size`` (``plan_graph_decode``).

    Args:
        batch_size: the bucket (requests = tokens).
        model: the model; ``input_ids``/``positions`` are views of the runner's persistent buffers.
        graph_metadata: what the backend returned for this bucket.
        tail: called on the model's output inside the graph; returns the bucket's logits
            ``[batch_size, vocab]`` and their argmax int64 ``[batch_size]`` (see
            ``CudaGraphRunner``'s ``capture_logits``), or None to end the graph at the hidden
            states.
    """

    def __init__(
        self,
        batch_size: int,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        graph_metadata: Any,
        tail: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> None:
        self.batch_size = batch_size
        self.model = model
        self.input_ids = input_ids
        self.positions = positions
        self.graph_metadata = graph_metadata
        self.tail = tail
        self.graph: torch.cuda.CUDAGraph | None = None
        self.output: torch.Tensor | None = None
        #: ``(logits, argmax)`` the captured tail writes, or None without a tail.
        self.tail_output: tuple[torch.Tensor, torch.Tensor] | None = None

    def run_eager(self, forward_meta) -> torch.Tensor:
        """The captured computation, eagerly (warm-up; the tail too, so its kernels are built
        before the capture)."""
        hidden = self.model(self.input_ids, self.positions, forward_meta)
        if self.tail is not None:
            self.tail(hidden)
        return hidden

    def capture(self, forward_meta, pool, stream: torch.cuda.Stream) -> None:
        """Capture ``model(input_ids, positions, forward_meta)``, then the tail, into one
        graph."""
        from fastdeploy.model_executor.graph_optimization.piecewise import capture_graph

        def forward() -> None:
            self.output = self.model(self.input_ids, self.positions, forward_meta)
            if self.tail is not None:
                self.tail_output = self.tail(self.output)

        self.graph = capture_graph(forward, pool, stream)

    def replay(self) -> torch.Tensor:
        """Replay; returns ``[batch_size, hidden]`` (a static tensor: consume before next step;
        so are :attr:`tail_output`'s)."""
        self.graph.replay()
        return self.output
