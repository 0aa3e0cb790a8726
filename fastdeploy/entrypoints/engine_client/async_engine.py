"""Asynchronous front of the engine for the API server.

The engine's step loop (:class:`~fastdeploy.engine.engine_loop.EngineLoop`) runs either in a
process of its own (:class:`~.process_client.EngineCoreProcess`, the server's default) or on one
background thread of the server process (:class:`~.thread_core.ThreadCore`:
``--disable-frontend-multiprocessing``, and
any engine object passed in directly, such as the tests' stand-ins). Everything else
(tokenisation, chat templates, HTTP and SSE streaming) runs on the server's asyncio thread.

The loop never waits on HTTP: it drains commands (adds, aborts) between steps, steps, and emits
one message per step, handled on the asyncio thread (which reads the engine process's pipe
when it is readable, or gets the engine thread's messages through
``loop.call_soon_threadsafe``), so a slow client never delays the next step. Each step's new
tokens and text reach the per-request asyncio queues (and so the streams) right after that step.
The engine itself detokenises (its stop checker needs the text to decide which requests end, and
a request ended by a stop string frees its KV blocks in that same step).

Why a process by default: with the engine on a thread both share one GIL, so what the asyncio
thread spends per step (at 64 streams, 64 new tokens) is taken from the engine's host time. With
the small SmolLM2-135M model on an H200 the step is itself host-bound: 64 streams were served at
11,141 output tok/s with the engine on a thread, 26,471 with it in its own process, against
37,998 to 42,033 offline (README, Benchmarks).

The hand-off is kept small: one message per step, each request's new output object handed over
as it is (no copies; see :mod:`~.output_processor`), one wake-up per stream, the
step's token metrics recorded at once; the SSE chunks are encoded from templates
(:mod:`~fastdeploy.entrypoints.openai.sse`). ``benchmarks/benchmark_server_overhead.py`` measures
it.

Admission checks (``check_request``) run here, on the asyncio thread, so a bad request is
answered with an HTTP error before any response starts.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from fastdeploy.core.messages import (
    AbortRequest,
    AddRequest,
    Command,
    Emit,
    EngineDead,
    EngineMessage,
    EngineStats,
    RequestFailed,
    StepOutputs,
    StopLoop,
)
from fastdeploy.core.outputs import EngineOutput
from fastdeploy.core.sampling_params import SamplingParams
from fastdeploy.entrypoints.engine_client.output_processor import OutputProcessor, RequestOutput
from fastdeploy.entrypoints.engine_client.process_client import EngineCoreClient
from fastdeploy.entrypoints.engine_client.request_stream import RequestOutputs, RequestStream
from fastdeploy.entrypoints.engine_client.stall_watch import (
    DEFAULT_ENGINE_STALL_TIMEOUT_S,
    StallWatch,
)
from fastdeploy.entrypoints.engine_client.thread_core import LocalEngine, ThreadCore
from fastdeploy.metrics import ServerMetrics, StepTokens

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

#: Seconds a client is told to wait (``Retry-After``) when the request queue is full.
RETRY_AFTER_S = 1
#: Seconds between the checks that log a stalled engine and set its metric.
STALL_CHECK_EVERY_S = 1.0


class QueueFullError(RuntimeError):
    """The server already holds ``max_concurrency`` requests; retry after ``retry_after`` s.
    ``limit``: what the limit is, for the message (default ``--max-concurrency``)."""

    def __init__(
        self, max_concurrency: int, retry_after: int = RETRY_AFTER_S, limit: str | None = None
    ) -> None:
        super().__init__(
            f"the server is at its limit of {max_concurrency} concurrent requests "
            f"({limit or '--max-concurrency'}); retry after {retry_after} s"
        )
        self.retry_after = retry_after


class EngineDeadError(RuntimeError):
    """The engine loop stopped (shutdown or a failed step); no request can make progress."""


__all__ = [
    "AsyncLLMEngine", "EngineCore", "EngineDeadError", "QueueFullError", "RequestStream",
]  # fmt: skip


class EngineCore(Protocol):
    """Where the engine loop runs, as :class:`AsyncLLMEngine` drives it: in a process of its
    own (:class:`~.process_client.EngineCoreClient`) or on a thread here
    (:class:`~.thread_core.ThreadCore`)."""

    tokenizer: PreTrainedTokenizerBase | None
    max_model_len: int
    max_model_len_note: str | None
    vocab_size: int

    @property
    def splitwise_role(self) -> str:
        """``mixed``, ``prefill`` or ``decode``."""

    def release_refused_leg(self, params: object) -> bool:
        """Free a refused decode leg's prefill blocks; whether an ABORT was started."""

    def check_request(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        kv_transfer_params: dict | None = None,
    ) -> Any:
        """The admission check; ``ValueError`` naming what is wrong."""

    def describe(self) -> dict:
        """``{"config": ..., "deployment_plan": ...}`` as dicts."""

    def start(self, emit: Emit, loop: asyncio.AbstractEventLoop) -> None:
        """Start the loop (or its reader); ``emit`` is then called on ``loop``'s thread."""

    def send(self, cmd: Command) -> None:
        """Send a command (any thread)."""

    def is_alive(self) -> bool:
        """Whether the loop may still answer."""

    def join(self, timeout_s: float) -> bool:
        """After ``StopLoop``: wait up to ``timeout_s`` seconds; True when it ended."""

    def close(self) -> None:
        """Release what is held (after :meth:`join` returned True)."""

    def kill(self) -> None:
        """Give up on the loop now."""


@dataclass
class _Tracked:
    """Per-request state on the asyncio side: its outputs and timing for the metrics."""

    outputs: RequestOutputs
    num_prompt_tokens: int
    arrival: float
    last_token_time: float | None = None


class AsyncLLMEngine:
    """Drives the engine loop and streams its outputs to asyncio consumers.

    Args:
        engine: an :class:`EngineCoreProcess` (the loop runs in that process) or an
            :class:`EngineCoreClient` (attached to one another process started), or an
            ``LLMEngine`` or anything with its methods (``check_request``, ``add_request``,
            ``abort_request``, ``step``, ``has_unfinished_requests``, ``get_stats``,
            ``shutdown`` and the attributes ``tokenizer``, ``max_model_len``, ``vocab_size``;
            ``max_model_len_note`` when it has one), whose loop then runs on a thread here.
        output_processor: turns ``EngineOutput`` lists into cumulative ``RequestOutput`` lists,
            new objects each step (they are handed to consumers as they are); default
            ``OutputProcessor()``.
        max_concurrency: requests admitted at once (running + waiting); more raise
            :class:`QueueFullError`. ``None`` means no limit.
        metrics: where to record; a fresh :class:`ServerMetrics` by default.
        engine_stall_timeout_s: seconds without a finished step, while there is work, after
            which :meth:`stall_reason` reports the engine as stalled (``/health`` answers 503);
            None or 0: never (:mod:`~.stall_watch`).

    Raises:
        ValueError: a bad ``engine_stall_timeout_s``.
    """

    def __init__(
        self,
        engine: EngineCoreClient | LocalEngine,
        output_processor: OutputProcessor | None = None,
        max_concurrency: int | None = None,
        metrics: ServerMetrics | None = None,
        engine_stall_timeout_s: float | None = DEFAULT_ENGINE_STALL_TIMEOUT_S,
    ) -> None:
        self._stall = StallWatch(engine_stall_timeout_s)
        self._stall_logged: str | None = None
        if output_processor is None:
            output_processor = OutputProcessor()
        self.engine = engine
        core = engine if isinstance(engine, EngineCoreClient) else ThreadCore(engine)
        self._core: EngineCore = core
        self.tokenizer = core.tokenizer
        self.max_model_len: int = core.max_model_len
        self.max_model_len_note: str | None = core.max_model_len_note
        self.vocab_size: int = core.vocab_size
        self.max_concurrency = max_concurrency
        #: What ``max_concurrency`` is, for the 429 message (None: ``--max-concurrency``).
        self.max_concurrency_note: str | None = None
        self.metrics = metrics if metrics is not None else ServerMetrics()
        self._processor = output_processor
        self._tracked: dict[str, _Tracked] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started = False
        self._dead: BaseException | None = None
        self.stats: dict = {}
        self._handlers: dict[type, Callable[[Any], None]] = {
            EngineStats: self._on_stats_message,
            StepOutputs: self._on_step_message,
            RequestFailed: self._on_failed_message,
            EngineDead: self._on_dead_message,
        }

    # ---------------------------------------------------------------- lifecycle (asyncio side)
    def start(self) -> None:
        """Start the engine loop (thread) or the reader of the engine process; call from inside
        the running asyncio loop."""
        if self._started:
            raise RuntimeError("AsyncLLMEngine.start() called twice")
        self._started = True
        self._loop = asyncio.get_running_loop()
        self._stall.progress(engine_busy=False)  # the loop starts now, idle
        self._core.start(self._dispatch, self._loop)
        if self._stall.timeout_s is not None:
            self._loop.call_later(STALL_CHECK_EVERY_S, self._check_stall)

    @property
    def is_running(self) -> bool:
        """True while the engine loop is alive and has not failed."""
        return self._started and self._core.is_alive() and self._dead is None

    @property
    def splitwise_role(self) -> str:
        """The engine's PD role: ``mixed``, ``prefill`` or ``decode`` (``mixed`` for an engine
        that does not say)."""
        return self._core.splitwise_role

    def release_refused_leg(self, params: object) -> bool:
        """A decode leg was refused before admission: free its prefill node's blocks now
        (``fastdeploy.splitwise.legs.release_refused_leg``, with the trusted prefill nodes of
        this node's admission). Returns whether an ABORT was started."""
        return self._core.release_refused_leg(params)

    def describe(self) -> dict:
        """The engine's resolved ``config`` and ``deployment_plan`` as dicts (for
        /v1/server_info)."""
        return self._core.describe()

    @property
    def engine_pid(self) -> int:
        """The process the engine loop runs in (this one for an engine on a thread)."""
        return getattr(self._core, "engine_pid", None) or os.getpid()

    def stall_reason(self) -> str | None:
        """Why the engine counts as stalled (no step finished for longer than
        ``engine_stall_timeout_s`` while there is work), or None."""
        return self._stall.reason(len(self._tracked))

    def _check_stall(self) -> None:
        """Log a stall as it starts and ends and keep its metric current; every
        :data:`STALL_CHECK_EVERY_S` while the engine runs (on the asyncio thread)."""
        if self._dead is not None:
            return
        reason = self.stall_reason()
        if (reason is None) != (self._stall_logged is None):
            if reason is not None:
                logger.error("%s; /health answers 503 until steps resume", reason)
            else:
                logger.warning("the engine finished a step again; /health answers 200")
            self.metrics.observe_stalled(reason is not None)
        self._stall_logged = reason
        self._loop.call_later(STALL_CHECK_EVERY_S, self._check_stall)

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the loop after the current step, fail in-flight requests, shut the engine down."""
        if self._dead is None:
            self._dead = EngineDeadError("the server is shutting down")
        self._core.send(StopLoop())
        stopped = await asyncio.to_thread(self._core.join, timeout_s)
        self._fail_all(self._dead)
        if not stopped:
            # Still inside a step: an engine process is killed; a thread cannot be (see
            # ThreadCore.kill), and releasing the model under it would be unsafe.
            logger.error("the engine loop did not stop within %.0f s", timeout_s)
            self._core.kill()
            return
        self._core.close()

    # ---------------------------------------------------------------- requests (asyncio side)
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        prompt: str | None = None,
        kv_transfer_params: dict | None = None,
    ) -> RequestStream:
        """Queue a request and return its stream. Checks run here, synchronously, so the caller
        can answer with an HTTP error before any response starts. ``kv_transfer_params`` makes
        it a leg of a PD request (see ``LLMEngine.add_request``).

        Raises:
            ValueError: what ``engine.check_request`` raises (empty prompt, prompt not shorter
                than ``max_model_len`` naming both lengths, a token id outside the vocabulary, a
                sampling parameter the model cannot honour), or a request id already in flight.
            QueueFullError: ``max_concurrency`` requests are already in flight.
            EngineDeadError: the engine loop is not running.
        """
        if self._dead is not None or not self._started:
            raise EngineDeadError(str(self._dead or "the engine loop is not running"))
        self._core.check_request(prompt_token_ids, sampling_params, kv_transfer_params)
        if request_id in self._tracked:
            raise ValueError(f"request id {request_id!r} is already in flight")
        if self.max_concurrency is not None and len(self._tracked) >= self.max_concurrency:
            raise QueueFullError(self.max_concurrency, limit=self.max_concurrency_note)
        self._processor.add_request(request_id, prompt, prompt_token_ids, sampling_params)
        self._stall.work_added(len(self._tracked))
        outputs = RequestOutputs()
        self._tracked[request_id] = _Tracked(outputs, len(prompt_token_ids), time.monotonic())
        self._core.send(
            AddRequest(request_id, list(prompt_token_ids), sampling_params, kv_transfer_params)
        )
        return RequestStream(self, request_id, outputs)

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        prompt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's ``RequestOutput`` objects (one per step with new tokens).

        If the consumer goes away (``CancelledError``, ``GeneratorExit``) the request is aborted
        and its KV blocks are freed. Raises what :meth:`add_request` raises, and
        :class:`EngineDeadError` if the loop stops while the request runs.
        """
        stream = self.add_request(request_id, prompt_token_ids, sampling_params, prompt)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        """Abort an in-flight request (no-op when it already finished). Safe from any thread."""
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return
        self._processor.abort_request(request_id)
        self._core.send(AbortRequest(request_id))
        self.metrics.observe_finish("abort", time.monotonic() - tracked.arrival)

    def fail_in_flight(self, message: str) -> int:
        """End every in-flight request with :class:`EngineDeadError` (``message``) and abort it in
        the engine, which keeps running. Used when a graceful shutdown runs out of time. Returns
        how many requests were ended."""
        return self._fail_all(EngineDeadError(message))

    @property
    def num_in_flight(self) -> int:
        """Requests admitted and not yet finished or aborted."""
        return len(self._tracked)

    # ---------------------------------------------------------------- engine side
    def _dispatch(self, message: EngineMessage) -> None:
        """A message of the engine loop (:mod:`fastdeploy.core.messages`), handled by its type;
        the core calls this on the asyncio thread."""
        self._handlers[type(message)](message)

    # ---------------------------------------------------------------- callbacks (asyncio side)
    def _on_stats_message(self, message: EngineStats) -> None:
        self._on_stats(message.stats)

    def _on_step_message(self, message: StepOutputs) -> None:
        self._on_step(message.outputs, message.stats, message.now)

    def _on_failed_message(self, message: RequestFailed) -> None:
        self._fail(message.request_id, message.error)

    def _on_dead_message(self, message: EngineDead) -> None:
        self._on_dead(message.error)

    def _on_stats(self, stats: dict) -> None:
        self.stats = stats
        self._stall.progress(bool(stats.get("num_running") or stats.get("num_waiting")))
        self.metrics.observe_stats(stats)

    def _on_step(self, outputs: list[EngineOutput], stats: dict, now: float) -> None:
        """Accumulate one step's outputs and hand each to its stream (one wake-up per stream);
        the step's token metrics are recorded at once."""
        self._on_stats(stats)
        tracked_by_id = self._tracked
        live = []
        for o in outputs:
            # Aborted requests may still produce tokens in the steps before the engine thread
            # sees their abort command.
            if o.request_id not in tracked_by_id:
                continue
            if o.error is not None:
                self._fail(o.request_id, o.error)
            else:
                live.append(o)
        if not live:
            return
        try:
            results = self._processor.process(live)
        except Exception as e:  # noqa: BLE001 - fail these requests, keep the server up
            logger.exception("output processing failed")
            for request_id in {o.request_id for o in live}:
                self._fail(request_id, RuntimeError(f"output processing failed: {e!r}"))
            return
        tokens = StepTokens()
        for ro in results:
            tracked = tracked_by_id.get(ro.request_id)
            if tracked is None:
                continue
            self._record_tokens(tracked, ro, now, tokens)
            tracked.outputs.put(ro)
            if ro.finished:
                del tracked_by_id[ro.request_id]
                reason = ro.outputs[0].finish_reason or "stop"
                self.metrics.observe_finish(reason, now - tracked.arrival)
        self.metrics.observe_step_tokens(tokens)

    def _record_tokens(
        self, tracked: _Tracked, ro: RequestOutput, now: float, tokens: StepTokens
    ) -> None:
        """Count one output's new tokens into ``tokens`` (and its TTFT, for a first token)."""
        num_new = len(ro.outputs[0].delta_token_ids)
        if num_new <= 0:
            return
        if tracked.last_token_time is None:
            self.metrics.observe_first_token(now - tracked.arrival, tracked.num_prompt_tokens)
            tokens.add(1, None)
            if num_new > 1:
                tokens.add(num_new - 1, 0.0)
        else:
            tokens.add(num_new, now - tracked.last_token_time)
        tracked.last_token_time = now

    def _fail(self, request_id: str, error: BaseException) -> None:
        """End one request with ``error`` (raised to its consumer) and abort it in the engine
        (harmless if the engine never had it or has stopped)."""
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return
        self._processor.abort_request(request_id)
        self._core.send(AbortRequest(request_id))
        self.metrics.observe_finish("error", time.monotonic() - tracked.arrival)
        tracked.outputs.put(error)

    def _on_dead(self, error: BaseException) -> None:
        """The engine loop failed (or its process exited): fail every request in flight and
        zero the gauges, since no engine holds requests or KV blocks any more."""
        self._dead = EngineDeadError(f"the engine loop failed: {error!r}")
        n = self._fail_all(self._dead)
        logger.error("%s; %d request(s) in flight failed; /health answers 503", self._dead, n)
        self._on_stats(
            {
                "num_running": 0,
                "num_waiting": 0,
                "num_waiting_for_remote_kv": 0,
                "kv_cache_usage": 0.0,
                "num_free_blocks": 0,
                "num_total_blocks": 0,
            }
        )

    def _fail_all(self, error: BaseException) -> int:
        """:meth:`_fail` every in-flight request; returns how many there were."""
        request_ids = list(self._tracked)
        for request_id in request_ids:
            self._fail(request_id, error)
        return len(request_ids)
