"""Background capture (issue #47): which graph is captured next, which buckets replay, and what
failed. Pure host bookkeeping; the worker captures (``GpuWorker.capture_next_graph``).

The engine serves as soon as the KV cache is allocated. Between steps, on the engine's own thread,
it captures one graph (a *task*: one prefill bucket's piecewise graphs, one decode bucket's full
graph, or one sampled-row logits graph). Captures never run on a second thread: a CUDA graph
capture records every kernel launched on the capturing stream, and in the default ``global``
capture mode another thread's CUDA calls during a capture invalidate it, so a step launched
concurrently would either corrupt the graph or be refused. Between steps the device is idle for
the engine's own work (the worker waits for the step in flight first), so each capture sees the
device alone and a step never sees a half-built graph.

Order (:func:`background_order`): phase 1 is what traffic needs first, decode buckets of at most
:data:`FIRST_DECODE_MAX` requests and prefill buckets of at most :data:`FIRST_PREFILL_MAX`
tokens; phase 2 is the rest. Within a phase, decode buckets come first (few and cheap, and a
request runs one decode step per token but one prefill), then prefill buckets, then the
sampled-row graphs of that phase's decode sizes (they need a piecewise bucket), each kind
largest first: the graphs share one memory pool, and a smaller graph captured after a
larger one reuses the blocks the larger one freed, so the pool grows only at the first (largest)
bucket of each kind in each phase (the phase-2 head then grows it past what phase 1 took; the
worker's graph-memory estimate counts that). The blocking order (:func:`blocking_order`) is one
phase: every prefill bucket, then every decode bucket, then the sampled-row graphs, largest
first, as before.

A bucket becomes *ready* (replayed) only when its capture returned: :class:`CaptureProgress`
replaces its ready sets with new frozensets after the graph is stored, so a dispatch that reads
them (on the same thread) sees a bucket either absent or complete. A capture that raised leaves
its bucket eager for good and is recorded with its reason (``failures``, exported as
``fastdeploy:cuda_graph_buckets_failed``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from fastdeploy.config.plan import GraphPlan

#: Largest decode bucket (requests) of the first phase: the batches of a lightly loaded server.
FIRST_DECODE_MAX = 8
#: Largest prefill bucket (tokens) of the first phase: short prompts and chunks.
FIRST_PREFILL_MAX = 512
#: The kinds of capture task, as the graph runner's capture log names them; a dispatched mode
#: maps to its kind by :data:`KIND_OF_MODE`.
KINDS = ("prefill", "decode", "sampled")
KIND_OF_MODE = {"piecewise": "prefill", "full": "decode"}


@dataclass(frozen=True)
class CaptureTask:
    """One graph to capture.

    Attributes:
        kind: ``prefill`` (piecewise graphs of a token bucket), ``decode`` (the full graph of a
            request bucket) or ``sampled`` (the sampled-row logits graph of a row bucket).
        size: the bucket (tokens for prefill, requests for decode, rows for sampled).
        phase: 1 (what traffic needs first) or 2; the blocking order is all phase 1.
    """

    kind: str
    size: int
    phase: int = 1

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind={self.kind!r} is invalid; allowed: {', '.join(KINDS)}")
        if not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"size={self.size!r} is invalid; allowed: an integer >= 1")
        if self.phase not in (1, 2):
            raise ValueError(f"phase={self.phase!r} is invalid; allowed: 1 or 2")


def _sampled_sizes(plan: GraphPlan, capture_logits: bool) -> list[int]:
    """The sampled-row graphs' buckets: one per decode bucket, with decode-graph logits and
    piecewise buckets (``GPUModelRunner.capture_model``)."""
    if capture_logits and plan.prefill_graphs and plan.decode_graphs:
        return list(plan.decode_capture_sizes)
    return []


def blocking_order(plan: GraphPlan, capture_logits: bool) -> list[CaptureTask]:
    """Every task in the order of the capture before serving: prefill buckets, decode buckets,
    sampled-row graphs, each largest first (the bucket lists are kept largest first)."""
    return (
        [CaptureTask("prefill", n) for n in plan.prefill_capture_sizes]
        + [CaptureTask("decode", b) for b in plan.decode_capture_sizes]
        + [CaptureTask("sampled", b) for b in _sampled_sizes(plan, capture_logits)]
    )


def background_order(
    plan: GraphPlan,
    capture_logits: bool,
    first_decode_max: int = FIRST_DECODE_MAX,
    first_prefill_max: int = FIRST_PREFILL_MAX,
) -> list[CaptureTask]:
    """Every task in background order (module docstring): phase 1 the decode buckets
    ``<= first_decode_max`` and prefill buckets ``<= first_prefill_max`` (and the sampled-row
    graphs ``<= first_decode_max``), phase 2 the rest; within a phase decode, prefill, sampled,
    each largest first.

    Example: prefill ``[1024, 512, 16]``, decode ``[16, 8, 1]``, no logits graphs ->
    decode 8, 1, prefill 512, 16 (phase 1), then decode 16, prefill 1024 (phase 2).
    """
    limits = {"prefill": first_prefill_max, "decode": first_decode_max, "sampled": first_decode_max}
    rank = {"decode": 0, "prefill": 1, "sampled": 2}
    # blocking_order is largest first per kind; a stable sort by kind keeps that.
    tasks = sorted(blocking_order(plan, capture_logits), key=lambda t: rank[t.kind])
    first = [CaptureTask(t.kind, t.size, 1) for t in tasks if t.size <= limits[t.kind]]
    rest = [CaptureTask(t.kind, t.size, 2) for t in tasks if t.size > limits[t.kind]]
    return first + rest


@dataclass(frozen=True)
class CaptureFailure:
    """A task whose capture raised: its bucket stays eager.

    Attributes:
        task: the task.
        reason: ``"<ExceptionType>: <message>"`` (on another tensor-parallel rank: that it
            failed there).
    """

    task: CaptureTask
    reason: str


@dataclass
class CaptureProgress:
    """The background capture's state: the tasks left, the ready buckets, the failures.

    Args:
        tasks: every task, in capture order.
        background: captured while serving (False: before serving; the progress then only
            reports).

    Attributes:
        ready: kind -> the sizes whose graphs replay (a frozenset, replaced, never mutated).
        failures: the tasks whose capture raised, in order.
        seconds: seconds spent capturing so far (wall clock, the captures only).
        seconds_by_phase: the same by phase (``"1"``, ``"2"``).
    """

    tasks: list[CaptureTask]
    background: bool = True
    ready: dict[str, frozenset[int]] = field(
        default_factory=lambda: dict.fromkeys(KINDS, frozenset())
    )
    failures: list[CaptureFailure] = field(default_factory=list)
    seconds: float = 0.0
    seconds_by_phase: dict[str, float] = field(default_factory=dict)
    _next: int = 0

    @property
    def done(self) -> bool:
        """Every task was captured or failed."""
        return self._next >= len(self.tasks)

    def next_task(self) -> CaptureTask | None:
        """The task to capture next (None when done); it stays next until :meth:`captured` or
        :meth:`failed` is called for it."""
        return None if self.done else self.tasks[self._next]

    def _advance(self, task: CaptureTask, seconds: float) -> None:
        if task != self.next_task():
            raise RuntimeError(f"capture of {task} out of order; next is {self.next_task()}")
        self._next += 1
        self._stats = None
        self.seconds += seconds
        key = str(task.phase)
        self.seconds_by_phase[key] = self.seconds_by_phase.get(key, 0.0) + seconds

    def captured(self, task: CaptureTask, seconds: float = 0.0) -> None:
        """``task``'s graph is stored and complete: its bucket replays from the next step.

        Raises:
            RuntimeError: ``task`` is not :meth:`next_task`.
        """
        self._advance(task, seconds)
        self.ready = {**self.ready, task.kind: self.ready[task.kind] | {task.size}}

    def failed(self, task: CaptureTask, reason: str, seconds: float = 0.0) -> None:
        """``task``'s capture raised: its bucket stays eager; ``reason`` is kept.

        Raises:
            RuntimeError: ``task`` is not :meth:`next_task`.
        """
        self._advance(task, seconds)
        self.failures.append(CaptureFailure(task, reason))

    def is_ready(self, mode: str, bucket: int | None) -> bool:
        """Whether a step dispatched to ``(mode, bucket)`` may replay: ``eager`` always is
        (nothing to replay); ``full``/``piecewise`` when that bucket's graph is ready."""
        kind = KIND_OF_MODE.get(mode)
        return kind is None or bucket in self.ready[kind]

    def __post_init__(self) -> None:
        self._stats: dict | None = None  # cached until the next captured() or failed()

    def stats(self) -> dict:
        """For ``get_stats`` (``/v1/server_info``, ``/metrics``): ``background`` (bool),
        ``total``, ``captured``, ``failed`` (tasks), ``done`` (bool), ``seconds`` (float),
        ``seconds_by_phase`` (phase -> float),
        ``by_kind`` (kind -> ``[captured, total]``), ``failures`` (``[{kind, size, reason}]``).
        Plain values, built once per change (the engine reads it after every step); a shallow
        copy: its nested dicts and lists are shared with later calls until the next change, so
        read them, do not edit them."""
        if self._stats is None:
            self._stats = self._build_stats()
        return dict(self._stats)

    def _build_stats(self) -> dict:
        totals = {k: sum(t.kind == k for t in self.tasks) for k in KINDS}
        return {
            "background": self.background,
            "total": len(self.tasks),
            "captured": sum(len(s) for s in self.ready.values()),
            "failed": len(self.failures),
            "done": self.done,
            "seconds": round(self.seconds, 3),
            "seconds_by_phase": {k: round(v, 3) for k, v in self.seconds_by_phase.items()},
            "by_kind": {k: [len(self.ready[k]), totals[k]] for k in KINDS if totals[k]},
            "failures": [
                {"kind": f.task.kind, "size": f.task.size, "reason": f.reason}
                for f in self.failures
            ],
        }


class GapPacer:
    """Whether the engine captures a graph in this gap between steps.

    Idle (no request running or waiting), always: nothing waits. Busy, at most ``busy_share``
    of the wall clock goes to capture: the next capture is due once the steps since the last one
    have run for ``last_capture_seconds * (1 - busy_share) / busy_share``. With the default 1/3,
    a capture of ``c`` seconds is followed by at least ``2c`` seconds of steps, so a decode
    stream's mean time per token during capture is about 1.5x its steady state plus the steps
    that run eagerly (the issue's bound is 2x; 0.5, tried first on the H200, gave 2.03x), and
    capture under constant load takes at most about three times as long as idle.

    Args:
        busy_share: the share of wall time capture may take while requests run, in (0, 1].
        clock: ``time.monotonic`` (tests pass their own).

    Raises:
        ValueError: ``busy_share`` outside (0, 1].
    """

    def __init__(self, busy_share: float = 1 / 3, clock=time.monotonic) -> None:
        if not 0 < busy_share <= 1:
            raise ValueError(f"busy_share={busy_share!r} is invalid; allowed: 0 < share <= 1")
        self.busy_share = busy_share
        self.clock = clock
        self._due = 0.0

    def due(self, busy: bool) -> bool:
        """Whether to capture now (``busy``: requests run or wait)."""
        return not busy or self.clock() >= self._due

    def record(self, seconds: float) -> None:
        """A capture of ``seconds`` just ended."""
        self._due = self.clock() + seconds * (1 - self.busy_share) / self.busy_share
