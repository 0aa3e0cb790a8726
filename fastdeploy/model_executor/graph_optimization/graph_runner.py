"""The captured CUDA graphs of one model, their memory pool and their static buffers.

A tool of the model runner, built from what it uses (the model, the attention backend, the plan, the
pool and stream, the buffer sizes); it never holds the runner. The runner prepares a step's inputs
in its persistent buffers, asks :meth:`GraphPlan.dispatch` for the mode and bucket, and calls
:meth:`CudaGraphRunner.replay_full` or :meth:`CudaGraphRunner.replay_piecewise`; at warm-up it
calls :meth:`CudaGraphRunner.capture_piecewise` and :meth:`CudaGraphRunner.capture_full_decode`
once per bucket, largest first within each capture phase (one phase before serving; two when
capturing in the background, :mod:`~fastdeploy.model_executor.graph_optimization.capture_order`).
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import logging
import time
from collections.abc import Callable

import torch

from fastdeploy import envs
from fastdeploy.model_executor.forward_meta import ForwardMeta
from fastdeploy.model_executor.graph_optimization.full_graph import FullGraph
from fastdeploy.model_executor.graph_optimization.logits_graph import SampledLogitsGraph
from fastdeploy.model_executor.graph_optimization.piecewise import (
    PiecewiseGraph,
    PiecewiseModel,
    SegmentBuffers,
    compile_segments,
    make_segments,
)
from fastdeploy.model_executor.graph_optimization.policy import GraphPlan
from fastdeploy.model_executor.layers.attention.backend import AttentionBackend, AttentionBatch

logger = logging.getLogger(__name__)


class CudaGraphRunner:
    """Capture (warm-up only) and replay of the plan's buckets.

    Args:
        model: the model; it offers the piecewise contract (:class:`PiecewiseModel`).
        attn_backend: the attention backend the model's steps use.
        plan: the resolved graph plan (bucket lists largest first).
        num_warmups: eager runs of a bucket before its capture.
        graph_opt_level: 0 plain segments; 1/2 segments compiled with ``torch.compile``.
        pool: the one memory pool every graph shares (a new one when None).
        stream: the side stream graphs are captured on (a new one when None).
        capture_logits: the full decode graphs also compute the LM head of every row, into one
            float32 ``[largest decode bucket, vocab]`` buffer that all decode
            buckets share, and its argmax (:func:`custom_ops.argmax_ops.argmax_rows`), so a
            decode step launches no logits or greedy sampling kernels of its own
            (:meth:`decode_logits`). The rows of a decode step nearly always all sample (a
            one-token prefill chunk short of its prompt's end does not, and the runner picks
            the sampling rows). The model must have ``compute_logits(hidden,
            out=)`` and an ``lm_head.weight`` ``[vocab, hidden]`` (not under tensor
            parallelism, whose head all-gathers into a tensor of its own). With it, a piecewise
            step's sampled rows get their logits and argmax from a graph too
            (:meth:`capture_sampled_logits`).
    """

    def __init__(
        self,
        model: PiecewiseModel,
        attn_backend: AttentionBackend,
        plan: GraphPlan,
        num_warmups: int,
        graph_opt_level: int,
        pool=None,
        stream: torch.cuda.Stream | None = None,
        capture_logits: bool = False,
    ) -> None:
        self.model = model
        self.attn_backend = attn_backend
        self.plan = plan
        self.num_warmups = num_warmups
        self.graph_opt_level = graph_opt_level
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        self.stream = stream if stream is not None else torch.cuda.Stream()
        self.piecewise: dict[int, PiecewiseGraph] = {}
        self.full: dict[int, FullGraph] = {}
        self.capture_log: list[tuple[str, int]] = []
        self._phase_start = 0  # capture_log index where the current phase began
        self.seconds: dict[str, float] = collections.defaultdict(float)  # capture time by phase
        self.capture_seconds = 0.0
        self.memory_bytes = 0
        self._capturing = False
        self._check_addresses = envs.FD_DEBUG_CUDAGRAPH_ADDRESSES()
        self._bufs: SegmentBuffers | None = None
        self.attn_layers = [layer.attn for layer in model.layers]
        self.capture_logits = capture_logits
        self._logits: torch.Tensor | None = None  # shared by the decode graphs' tails
        self.sampled: dict[int, SampledLogitsGraph] = {}  # piecewise steps' sampled rows
        self._sampled_sizes: list[int] = []  # its buckets, ascending

    # ----------------------------------------------------------- capture
    def begin_capture(self) -> None:
        """Open the capture window (warm-up, or the background capture's whole run);
        :meth:`end_capture` closes it for good."""
        self._capturing = True

    def end_capture(self) -> None:
        """Close the capture window: no bucket is captured after it, and none lazily on a
        step's demand."""
        self._capturing = False

    def begin_phase(self) -> None:
        """Start a new capture phase: each kind's buckets are again captured largest first from
        here (the background order's second phase,
        :func:`~fastdeploy.model_executor.graph_optimization.capture_order.background_order`)."""
        self._phase_start = len(self.capture_log)

    def _check_order(self, kind: str, size: int) -> None:
        if not self._capturing:
            raise RuntimeError(
                f"capture of {kind} bucket {size} outside the capture window: buckets are "
                "captured at warm-up or by the background capture, never on a step's demand"
            )
        prev = [s for k, s in self.capture_log[self._phase_start :] if k == kind]
        if prev and size >= prev[-1]:
            raise RuntimeError(
                f"{kind} buckets must be captured largest first within a phase; {size} came "
                f"after {prev[-1]}"
            )
        self.capture_log.append((kind, size))

    def _warm_up_and_capture(
        self,
        phase: str,
        run_eager: Callable[[], object],
        capture: Callable[[], object],
        release_warm_up: bool = True,
    ) -> None:
        """The one warm-up-then-capture sequence of every bucket: ``num_warmups`` eager runs
        on the capture stream, a wait for them, then ``capture()``; the seconds of each part
        are added to ``seconds[f"{phase} warm-up"]`` and ``seconds[f"{phase} capture"]``.

        ``release_warm_up``: empty the allocator cache between the two. The warm-up's
        activations sit in the capture stream's cache; released before the graphs' pool grows,
        they are never reserved at the same time as it.
        """
        t0 = time.perf_counter()
        with torch.cuda.stream(self.stream):
            for _ in range(self.num_warmups):
                run_eager()
        self.stream.synchronize()
        if release_warm_up:
            torch.cuda.empty_cache()
        t1 = time.perf_counter()
        capture()
        self.seconds[f"{phase} warm-up"] += t1 - t0
        self.seconds[f"{phase} capture"] += time.perf_counter() - t1

    def segment_buffers(self) -> SegmentBuffers:
        """The static tensors every segment reads and writes, sized for the largest prefill
        bucket; allocated at the first capture, so the capture log counts them as graph memory."""
        if self._bufs is None:
            backend = self.attn_backend
            self._bufs = SegmentBuffers(
                max(self.plan.prefill_capture_sizes),
                self.model.hidden_size,
                backend.num_heads * backend.head_dim,
                backend.num_kv_heads * backend.head_dim,
                backend.dtype,
                backend.device,
                merged_qkv=self.graph_opt_level == 0,
            )
        return self._bufs

    def capture_piecewise(
        self,
        num_tokens: int,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        forward_meta: ForwardMeta,
    ) -> None:
        """Capture the piecewise graphs of one token bucket.

        Args:
            num_tokens: the bucket (tokens).
            input_ids, positions: int64 ``[num_tokens]`` views of the runner's persistent
                buffers, holding a prepared step of exactly ``num_tokens`` tokens.
            forward_meta: that step's metadata (attention run eagerly between segments). Its
                slot mapping must be the runner's persistent buffer: at ``graph_opt_level`` 0
                the segments write each layer's K/V through it inside the graphs, and every
                replay of the bucket reads the same view.

        Raises:
            RuntimeError: outside the capture window, or not largest first.
        """
        self._check_order("prefill", num_tokens)
        bufs = self.segment_buffers()
        kv_stores = None
        if self.graph_opt_level == 0:  # torch.compile'd segments keep the KV write eager
            slots = forward_meta.attn_metadata.slot_mapping
            kv_stores = [(forward_meta.kv_caches[a.layer_idx], slots) for a in self.attn_layers]
        segments = make_segments(self.model, bufs, input_ids, positions, kv_stores)
        segments = compile_segments(segments, self.graph_opt_level)
        graph = PiecewiseGraph(
            num_tokens, segments, bufs, self.attn_layers, kv_in_segments=kv_stores is not None
        )
        self._warm_up_and_capture(
            "prefill",
            lambda: graph.run_eager(forward_meta),
            lambda: graph.capture(self.pool, self.stream),
        )
        graph.input_ptr = input_ids.data_ptr()
        self.piecewise[num_tokens] = graph

    def capture_full_decode(
        self,
        batch_size: int,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        forward_meta: ForwardMeta,
    ) -> None:
        """Capture one full decode graph.

        Args:
            batch_size: the bucket (requests, one token each).
            input_ids, positions: int64 ``[batch_size]`` views of the persistent buffers.
            batch: the prepared decode step of exactly ``batch_size`` requests.
            forward_meta: its KV caches and backend; the attention metadata is replaced by the
                backend's fixed-size graph metadata for this bucket.

        Raises:
            RuntimeError: outside the capture window, or not largest first.
        """
        self._check_order("decode", batch_size)
        backend = self.attn_backend
        graph_meta = backend.make_graph_decode_metadata(batch_size)
        meta = dataclasses.replace(
            forward_meta, attn_metadata=backend.plan_graph_decode(graph_meta, batch, batch_size)
        )
        tail = self._logits_tail(batch_size) if self.capture_logits else None
        graph = FullGraph(batch_size, self.model, input_ids, positions, graph_meta, tail)
        self._warm_up_and_capture(
            "decode",
            lambda: graph.run_eager(meta),
            lambda: graph.capture(meta, self.pool, self.stream),
        )
        graph.input_ptr = input_ids.data_ptr()
        self.full[batch_size] = graph

    def _logits_tail(self, batch_size: int):
        """The tail of a decode graph of ``batch_size`` rows: the logits into its rows of the
        shared buffer (allocated at the first decode capture, sized for the plan's largest
        decode bucket, whichever bucket comes first), and their argmax."""
        from custom_ops.argmax_ops import argmax_rows

        if self._logits is None:
            weight = self.model.lm_head.weight
            rows = max([batch_size, *self.plan.decode_capture_sizes])
            self._logits = torch.empty(  # float32: the LM head's logits are never rounded
                rows, weight.shape[0], dtype=torch.float32, device=weight.device
            )
        if batch_size > self._logits.shape[0]:
            raise RuntimeError(
                f"a logits tail of {batch_size} rows after the shared buffer was sized for "
                f"{self._logits.shape[0]}: the plan's largest decode bucket is smaller"
            )
        rows = self._logits[:batch_size]
        model = self.model

        def tail(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            logits = model.compute_logits(hidden, out=rows)
            return logits, argmax_rows(logits)

        return tail

    def capture_sampled_logits(self, rows: int, logits_indices: torch.Tensor) -> None:
        """Capture the LM head and argmax of up to ``rows`` sampled rows of a piecewise step
        (:class:`~fastdeploy.model_executor.graph_optimization.logits_graph.SampledLogitsGraph`),
        after the piecewise buckets, largest first.

        Args:
            rows: the bucket (sampled rows).
            logits_indices: the runner's persistent int64 buffer of sampled rows (at least
                ``rows`` entries), as its steps write it.

        Raises:
            RuntimeError: outside the capture window, not largest first, without
                ``capture_logits`` or before any piecewise bucket.
        """
        if not self.capture_logits or not self.piecewise:
            raise RuntimeError(
                "sampled-row logits graphs need capture_logits and the piecewise buckets first"
            )
        self._check_order("sampled", rows)
        graph = SampledLogitsGraph(
            rows, self.segment_buffers().hidden, logits_indices[:rows], self._logits_tail(rows)
        )
        # Its warm-up allocates little beyond the shared logits rows (a gather of ``rows``
        # hidden rows and their argmax), so the cache is not emptied before its capture.
        self._warm_up_and_capture(
            "sampled",
            graph.run_eager,
            lambda: graph.capture(self.pool, self.stream),
            release_warm_up=False,
        )
        self.sampled[rows] = graph
        self._sampled_sizes = sorted(self.sampled)

    # ----------------------------------------------------------- replay
    def sampled_logits(self, num_rows: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """After :meth:`replay_piecewise`: replay the smallest sampled-row bucket holding
        ``num_rows`` rows, whose indices the step's ``prepare`` wrote. Returns ``(logits
        [bucket, vocab], argmax int64 [bucket])`` in the order of those indices (static
        tensors; rows past ``num_rows`` are padding), or None when no bucket holds them (none
        captured, or more rows than the largest)."""
        sizes = self._sampled_sizes
        i = bisect.bisect_left(sizes, num_rows)
        return self.sampled[sizes[i]].replay() if i < len(sizes) else None

    def decode_logits(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """What the last replay of decode bucket ``bucket`` computed after the hidden states:
        ``(logits [bucket, vocab], argmax int64 [bucket])``, static tensors (consume them
        before the next step) whose rows past the step's requests are padding; None when the
        graphs were captured without ``capture_logits``."""
        return self.full[bucket].tail_output

    def replay_full(
        self, bucket: int, input_ids: torch.Tensor, batch: AttentionBatch
    ) -> torch.Tensor:
        """Replay the full decode graph of ``bucket`` for a step prepared padded to it.

        Returns:
            ``[bucket, hidden]`` (a static tensor: consume it before the next step); rows past
            the step's requests are padding.
        """
        graph = self.full[bucket]
        self._assert_address(graph, input_ids)
        self.attn_backend.plan_graph_decode(graph.graph_metadata, batch, bucket)
        return graph.replay()

    def replay_piecewise(
        self, bucket: int, input_ids: torch.Tensor, forward_meta: ForwardMeta
    ) -> torch.Tensor:
        """Replay the segments of ``bucket`` with eager attention between them.

        Returns:
            ``[bucket, hidden]`` (a view of the shared segment buffer: consume it before the
            next step); rows past the step's tokens are padding.
        """
        graph = self.piecewise[bucket]
        self._assert_address(graph, input_ids)
        return graph.replay(forward_meta)

    def _assert_address(self, graph, input_ids: torch.Tensor) -> None:
        if self._check_addresses and input_ids.data_ptr() != graph.input_ptr:
            raise AssertionError("replay input address differs from the captured one")

    def num_graphs(self) -> int:
        """CUDA graphs held: one per decode bucket, ``L + 1`` per prefill bucket, one per
        sampled-row bucket."""
        pieces = sum(len(g.graphs) for g in self.piecewise.values())
        return len(self.full) + pieces + len(self.sampled)

    def discard(self, kind: str, size: int) -> None:
        """Drop the graph of one bucket (``kind`` ``prefill``, ``decode`` or ``sampled``): its
        steps run eagerly. A tensor-parallel rank that captured a bucket another rank failed
        to capture drops it, so the ranks replay the same buckets. Its pool blocks stay
        reserved by the pool."""
        table = {"prefill": self.piecewise, "decode": self.full, "sampled": self.sampled}[kind]
        table.pop(size, None)
        self._sampled_sizes = sorted(self.sampled)

    def release(self) -> None:
        """Drop every graph and buffer (engine shutdown, or a failed capture)."""
        self.piecewise.clear()
        self.full.clear()
        self.sampled.clear()
        self._sampled_sizes = []
        self._bufs = None
        self._logits = None
