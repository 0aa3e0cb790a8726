"""Asynchronous front of :class:`~fastdeploy.engine.engine.LLMEngine` for the API server.

Structure: the engine's step loop runs on ONE dedicated background thread, and detokenises there
(below); everything else (tokenisation, chat templates, HTTP and SSE streaming) runs on the
server's asyncio thread. Why a thread and not a separate process:

* a model step that waits on the device spends that time in calls that release the GIL, so
  the asyncio thread keeps serving HTTP meanwhile (true of large models; see the measured limit
  below for small ones);
* one process keeps the KV cache state, the scheduler and the metrics in one place, with no
  serialisation of requests or outputs between processes;
* the loop never waits on HTTP: it only drains a thread-safe command queue between steps (adds,
  aborts), steps, and posts each step's outputs to the asyncio loop with
  ``loop.call_soon_threadsafe``, so a slow client never delays the next step. Each step's new
  tokens and text reach the per-request asyncio queues (and so the streams) right after that step.
  The engine itself detokenises (its stop checker needs the text to decide which requests end,
  and a request ended by a stop string frees its KV blocks in that same step).

Both threads share one GIL, so what the asyncio thread spends per step (at 64 streams, 64 new
tokens) is taken from the engine's host time. Measured limit of this design: with the small
SmolLM2-135M model on an H200 the engine's step is itself host-bound (about 1 ms of host work
per step), so the two threads contend for the GIL: 7,062 output
tok/s served against 42,033 offline at 64 streams. Moving the engine loop into a process of its
own (vLLM's engine core) is the known remedy and is not built yet.

The hand-off is kept small: one callback per step, each request's new output object handed
over as it is (no copies; see
:mod:`~fastdeploy.engine.output_processor`), one wake-up per stream, the step's token metrics
recorded at once; the SSE chunks are encoded from templates
(:mod:`~fastdeploy.entrypoints.openai.sse`). ``benchmarks/benchmark_server_overhead.py`` measures
it.

All calls into the engine (``add_request``, ``abort_request``, ``step``, ``get_stats``) happen on
the engine thread, so the engine itself needs no locks; ``check_request`` is pure and runs on the
asyncio thread.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastdeploy.core.sampling_params import SamplingParams
from fastdeploy.engine.request_stream import RequestOutputs, RequestStream
from fastdeploy.metrics import ServerMetrics, StepTokens

logger = logging.getLogger(__name__)

#: Seconds a client is told to wait (``Retry-After``) when the request queue is full.
RETRY_AFTER_S = 1


class QueueFullError(RuntimeError):
    """The server already holds ``max_concurrency`` requests; retry after ``retry_after`` s."""

    def __init__(self, max_concurrency: int, retry_after: int = RETRY_AFTER_S) -> None:
        super().__init__(
            f"the server is at its limit of {max_concurrency} concurrent requests "
            f"(--max-concurrency); retry after {retry_after} s"
        )
        self.retry_after = retry_after


class EngineDeadError(RuntimeError):
    """The engine loop stopped (shutdown or a failed step); no request can make progress."""


# Commands from the asyncio side to the engine thread, applied between steps by ``_drain``.
@dataclass(frozen=True)
class AddRequest:
    """Queue a request that already passed ``engine.check_request``."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    kv_transfer_params: dict | None = None


@dataclass(frozen=True)
class AbortRequest:
    """Abort a request and free its KV blocks (a no-op for an unknown id)."""

    request_id: str


@dataclass(frozen=True)
class StopLoop:
    """Leave the engine loop."""


@dataclass(frozen=True)
class Wake:
    """Step again now: background work ended (a PD pull finished)."""


Command = AddRequest | AbortRequest | StopLoop | Wake

#: Seconds the loop waits for a command when it has nothing to step, or when its last step found
#: nothing to run while PD work (pulls, pending sends) goes on in the background.
IDLE_WAIT_S = 0.5


@dataclass
class _Tracked:
    """Per-request state on the asyncio side: its outputs and timing for the metrics."""

    outputs: RequestOutputs
    num_prompt_tokens: int
    arrival: float
    last_token_time: float | None = None


class AsyncLLMEngine:
    """Runs ``engine.step()`` on a background thread and streams outputs to asyncio consumers.

    Args:
        engine: an ``LLMEngine`` (or anything with its methods: ``check_request``,
            ``add_request``, ``abort_request``, ``step``, ``has_unfinished_requests``,
            ``get_stats``, ``shutdown`` and the attributes ``tokenizer``, ``max_model_len``,
            ``vocab_size``; ``max_model_len_note`` when it has one).
        output_processor: turns ``EngineOutput`` lists into cumulative ``RequestOutput`` lists,
            new objects each step (they are handed to consumers as they are); default
            ``OutputProcessor()``.
        max_concurrency: requests admitted at once (running + waiting); more raise
            :class:`QueueFullError`. ``None`` means no limit.
        metrics: where to record; a fresh :class:`ServerMetrics` by default.
    """

    def __init__(
        self,
        engine: Any,
        output_processor: Any = None,
        max_concurrency: int | None = None,
        metrics: ServerMetrics | None = None,
    ) -> None:
        if output_processor is None:
            from fastdeploy.engine.output_processor import OutputProcessor

            output_processor = OutputProcessor()
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len: int = engine.max_model_len
        self.max_model_len_note: str | None = getattr(engine, "max_model_len_note", None)
        self.vocab_size: int = engine.vocab_size
        self.max_concurrency = max_concurrency
        self.metrics = metrics if metrics is not None else ServerMetrics()
        self._processor = output_processor
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._dead: BaseException | None = None
        self.stats: dict = {}

    # ---------------------------------------------------------------- lifecycle (asyncio side)
    def start(self) -> None:
        """Start the engine thread; call from inside the running asyncio loop."""
        if self._thread is not None:
            raise RuntimeError("AsyncLLMEngine.start() called twice")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="fastdeploy-engine", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        """True while the engine thread is alive and has not failed."""
        return self._thread is not None and self._thread.is_alive() and self._dead is None

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the loop after the current step, fail in-flight requests, shut the engine down."""
        if self._dead is None:
            self._dead = EngineDeadError("the server is shutting down")
        self._commands.put(StopLoop())
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout_s)
        self._fail_all(self._dead)
        if self._thread is not None and self._thread.is_alive():
            # Still inside a step: releasing the model under it would be unsafe. The thread is a
            # daemon, so it does not keep the process alive.
            logger.error("engine thread did not stop within %.0f s", timeout_s)
            return
        self.engine.shutdown()

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
        if self._dead is not None or self._thread is None:
            raise EngineDeadError(str(self._dead or "the engine loop is not running"))
        # pure: safe off the engine thread
        if kv_transfer_params is None:
            self.engine.check_request(prompt_token_ids, sampling_params)
        else:
            self.engine.check_request(prompt_token_ids, sampling_params, kv_transfer_params)
        if request_id in self._tracked:
            raise ValueError(f"request id {request_id!r} is already in flight")
        if self.max_concurrency is not None and len(self._tracked) >= self.max_concurrency:
            raise QueueFullError(self.max_concurrency)
        self._processor.add_request(request_id, prompt, prompt_token_ids, sampling_params)
        outputs = RequestOutputs()
        self._tracked[request_id] = _Tracked(outputs, len(prompt_token_ids), time.monotonic())
        self._commands.put(
            AddRequest(request_id, list(prompt_token_ids), sampling_params, kv_transfer_params)
        )
        return RequestStream(self, request_id, outputs)

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        prompt: str | None = None,
    ) -> AsyncIterator[Any]:
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
        self._commands.put(AbortRequest(request_id))
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

    # ---------------------------------------------------------------- engine thread
    def _run(self) -> None:
        """The engine loop: drain commands, step while there is work, post outputs."""
        engine = self.engine
        background = getattr(engine, "has_background_work", lambda: False)
        set_wakeup = getattr(engine, "set_wakeup", None)
        if set_wakeup is not None:
            set_wakeup(lambda: self._commands.put(Wake()))
        try:
            self._post(self._on_stats, engine.get_stats())
            while True:
                busy = engine.has_unfinished_requests() and not getattr(
                    engine, "last_step_idle", False
                )
                if not self._drain(block=not busy):
                    return
                if engine.has_unfinished_requests() or background():
                    outputs = engine.step()
                    now = time.monotonic()
                    self._post(self._on_step, outputs, engine.get_stats(), now)
        except BaseException as e:  # noqa: BLE001 - report any failure to the waiting clients
            logger.exception("engine loop failed")
            self._post(self._on_dead, e)

    def _drain(self, block: bool) -> bool:
        """Apply queued commands; wait for one first when ``block``. False means stop."""
        changed = False
        while True:
            try:
                cmd: Command = (
                    self._commands.get(timeout=IDLE_WAIT_S)
                    if block
                    else self._commands.get_nowait()
                )
            except queue.Empty:
                break  # idle: let the loop check background work, then wait again
            block = False
            if isinstance(cmd, StopLoop):
                return False
            if isinstance(cmd, Wake):
                continue
            changed = True
            if isinstance(cmd, AddRequest):
                try:
                    if cmd.kv_transfer_params is None:
                        self.engine.add_request(
                            cmd.request_id, cmd.prompt_token_ids, cmd.sampling_params
                        )
                    else:
                        self.engine.add_request(
                            cmd.request_id,
                            cmd.prompt_token_ids,
                            cmd.sampling_params,
                            cmd.kv_transfer_params,
                        )
                except ValueError as e:
                    self._post(self._fail, cmd.request_id, e)
            elif isinstance(cmd, AbortRequest):
                self.engine.abort_request(cmd.request_id)
        if changed:
            self._post(self._on_stats, self.engine.get_stats())
        return True

    def _post(self, fn: Any, *args: Any) -> None:
        """Run ``fn(*args)`` on the asyncio loop (dropped if the loop is already closed)."""
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass

    # ---------------------------------------------------------------- callbacks (asyncio side)
    def _on_stats(self, stats: dict) -> None:
        self.stats = stats
        self.metrics.observe_stats(stats)

    def _on_step(self, outputs: list, stats: dict, now: float) -> None:
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

    def _record_tokens(self, tracked: _Tracked, ro: Any, now: float, tokens: StepTokens) -> None:
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
        self._commands.put(AbortRequest(request_id))
        self.metrics.observe_finish("error", time.monotonic() - tracked.arrival)
        tracked.outputs.put(error)

    def _on_dead(self, error: BaseException) -> None:
        self._dead = EngineDeadError(f"the engine loop failed: {error!r}")
        self._fail_all(self._dead)

    def _fail_all(self, error: BaseException) -> int:
        """:meth:`_fail` every in-flight request; returns how many there were."""
        request_ids = list(self._tracked)
        for request_id in request_ids:
            self._fail(request_id, error)
        return len(request_ids)
