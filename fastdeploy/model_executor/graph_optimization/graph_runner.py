"""Capture (warm-up only) and dispatch of CUDA graphs for one model runner.

Dispatch uses host-side scheduler data only (no device sync):
  * decode-only step of ``B`` requests, decode graphs on, ``B`` <= largest decode bucket
    -> replay the full graph of the smallest bucket >= ``B``;
  * any other step of ``N`` tokens, prefill graphs on, ``N`` <= largest prefill bucket
    -> piecewise replay of the smallest bucket >= ``N``;
  * otherwise eager.
"""

from __future__ import annotations

import collections
import logging
import math
import time

import torch

from fastdeploy import envs
from fastdeploy.core.scheduler_output import SchedulerOutput
from fastdeploy.model_executor.graph_optimization.capture_sizes import pick_bucket
from fastdeploy.model_executor.graph_optimization.full_graph import FullGraph
from fastdeploy.model_executor.graph_optimization.piecewise import (
    PiecewiseGraph,
    SegmentBuffers,
    compile_segments,
    make_segments,
)
from fastdeploy.model_executor.graph_optimization.policy import GraphPlan

logger = logging.getLogger(__name__)


class CudaGraphRunner:
    """Holds the captured graphs of one runner, their memory pool and their static buffers.

    Args:
        runner: the :class:`~fastdeploy.worker.gpu_model_runner.GPUModelRunner`.
        plan: the resolved graph plan (bucket lists largest first).
        num_warmups: eager runs of a bucket before its capture.
        graph_opt_level: 0 plain segments; 1/2 segments compiled with ``torch.compile``.
    """

    def __init__(self, runner, plan: GraphPlan, num_warmups: int, graph_opt_level: int) -> None:
        self.runner = runner
        self.plan = plan
        self.num_warmups = num_warmups
        self.graph_opt_level = graph_opt_level
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream()
        self.piecewise: dict[int, PiecewiseGraph] = {}
        self.full: dict[int, FullGraph] = {}
        self.capture_log: list[tuple[str, int]] = []
        self.seconds: dict[str, float] = collections.defaultdict(float)  # capture time by phase
        self._capturing = False
        self._bufs: SegmentBuffers | None = None
        self._check_addresses = envs.FD_DEBUG_CUDAGRAPH_ADDRESSES()
        model = runner.model
        self.attn_layers = [layer.attn for layer in model.layers]

    # ----------------------------------------------------------- capture
    def begin_capture(self) -> None:
        """Open the capture window (warm-up only); :meth:`end_capture` closes it for good."""
        self._capturing = True

    def end_capture(self) -> None:
        self._capturing = False

    def _check_order(self, kind: str, size: int) -> None:
        if not self._capturing:
            raise RuntimeError(
                f"capture of {kind} bucket {size} outside warm-up: buckets are "
                "captured during warm-up only, never lazily while serving"
            )
        prev = [s for k, s in self.capture_log if k == kind]
        if prev and size >= prev[-1]:
            raise RuntimeError(
                f"{kind} buckets must be captured largest first; {size} came after {prev[-1]}"
            )
        self.capture_log.append((kind, size))

    def segment_buffers(self) -> SegmentBuffers:
        if self._bufs is None:
            backend = self.runner.attn_backend
            hidden = self.runner.model.embed_tokens.weight.shape[1]
            self._bufs = SegmentBuffers(
                max(self.plan.prefill_capture_sizes),
                hidden,
                backend.num_heads * backend.head_dim,
                backend.num_kv_heads * backend.head_dim,
                backend.dtype,
                backend.device,
            )
        return self._bufs

    def capture_piecewise(self, num_tokens: int, sched: SchedulerOutput) -> None:
        """Capture the piecewise graphs of one token bucket from a dummy step of exactly
        ``num_tokens`` tokens."""
        self._check_order("prefill", num_tokens)
        runner = self.runner
        inputs = runner.buffers.prepare(sched, padded=num_tokens)
        meta = runner.build_forward_meta(inputs, "piecewise")
        segments = make_segments(
            runner.model, self.segment_buffers(), inputs.input_ids, inputs.positions
        )
        segments = compile_segments(segments, self.graph_opt_level)
        graph = PiecewiseGraph(num_tokens, segments, self.segment_buffers(), self.attn_layers)
        t0 = time.perf_counter()
        with torch.cuda.stream(self.stream):
            for _ in range(self.num_warmups):
                graph.run_eager(meta)
        self.stream.synchronize()
        t1 = time.perf_counter()
        graph.capture(self.pool, self.stream)
        self.seconds["prefill warm-up"] += t1 - t0
        self.seconds["prefill capture"] += time.perf_counter() - t1
        graph.input_ptr = inputs.input_ids.data_ptr()
        self.piecewise[num_tokens] = graph

    def capture_full_decode(self, batch_size: int, sched: SchedulerOutput) -> None:
        """Capture one full decode graph from a dummy decode step of ``batch_size`` requests."""
        self._check_order("decode", batch_size)
        runner = self.runner
        backend = runner.attn_backend
        inputs = runner.buffers.prepare(sched, padded=batch_size)
        graph_meta = backend.make_graph_decode_metadata(batch_size)
        meta = runner.build_forward_meta(inputs, "full")
        meta.attn_metadata = backend.plan_graph_decode(graph_meta, inputs.batch, batch_size)
        graph = FullGraph(batch_size, runner.model, inputs.input_ids, inputs.positions, graph_meta)
        t0 = time.perf_counter()
        with torch.cuda.stream(self.stream):
            for _ in range(self.num_warmups):
                graph.run_eager(meta)
        self.stream.synchronize()
        t1 = time.perf_counter()
        graph.capture(meta, self.pool, self.stream)
        self.seconds["decode warm-up"] += t1 - t0
        self.seconds["decode capture"] += time.perf_counter() - t1
        graph.input_ptr = inputs.input_ids.data_ptr()
        self.full[batch_size] = graph

    # ----------------------------------------------------------- dispatch
    def try_run(self, runner, sched: SchedulerOutput):
        """Replay a graph for ``sched`` if one fits; returns ``(hidden, inputs, mode)`` or None.

        ``hidden`` is ``[padded, H]``; rows past ``inputs.num_tokens`` are padding.
        """
        if sched.is_decode_only and self.full:
            bucket = pick_bucket(self.plan.decode_capture_sizes, len(sched.scheduled))
            if bucket is not None and bucket in self.full:
                graph = self.full[bucket]
                inputs = runner.buffers.prepare(sched, padded=bucket)
                self._assert_address(graph, inputs)
                runner.attn_backend.plan_graph_decode(graph.graph_metadata, inputs.batch, bucket)
                return graph.replay(), inputs, "full"
            return None
        if sched.is_decode_only and self.plan.decode_graphs:
            return None  # decode-only above the largest decode bucket: eager
        if self.piecewise:
            bucket = pick_bucket(self.plan.prefill_capture_sizes, sched.num_batched_tokens)
            if bucket is not None and bucket in self.piecewise:
                graph = self.piecewise[bucket]
                inputs = runner.buffers.prepare(sched, padded=bucket)
                self._assert_address(graph, inputs)
                meta = runner.build_forward_meta(inputs, "piecewise")
                return graph.replay(meta), inputs, "piecewise"
        return None

    def _assert_address(self, graph, inputs) -> None:
        if self._check_addresses and inputs.input_ids.data_ptr() != graph.input_ptr:
            raise AssertionError("replay input address differs from the captured one")

    def num_graphs(self) -> int:
        """CUDA graphs held: one per decode bucket, ``L + 1`` per prefill bucket."""
        return len(self.full) + sum(len(g.graphs) for g in self.piecewise.values())

    def release(self) -> None:
        """Drop every graph and buffer (engine shutdown)."""
        self.piecewise.clear()
        self.full.clear()
        self._bufs = None


def split_tokens(num_tokens: int, max_per_request: int) -> list[int]:
    """Split a dummy step of ``num_tokens`` into request sizes of at most ``max_per_request``."""
    n = math.ceil(num_tokens / max_per_request)
    base, extra = divmod(num_tokens, n)
    return [base + (1 if i < extra else 0) for i in range(n)]
