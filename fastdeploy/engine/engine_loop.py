"""The loop that drives an engine for the API server, and where it runs.

:class:`EngineLoop` drains commands (adds, aborts) between steps, steps while there is work, and
emits each step's outputs and stats as messages. It never waits on HTTP. The same loop runs

* in a process of its own (the default of the server;
  :class:`~fastdeploy.engine.engine_core_proc.EngineCoreProcess`), where the messages travel over
  a pipe, or
* on a thread of the server process (:class:`ThreadCore`; ``--disable-frontend-multiprocessing``
  and the tests' stand-in engines), where they are posted to the asyncio loop directly.

Messages are ``(kind, *args)`` tuples, handled by
:class:`~fastdeploy.engine.async_engine.AsyncLLMEngine`:

* ``("stats", stats)``: the engine's counters (``LLMEngine.get_stats``), at start and after
  commands that no step follows (a step's own message carries them otherwise);
* ``("step", outputs, stats, now)``: one step's ``EngineOutput`` list, the counters after it and
  the ``time.monotonic()`` it ended (the clock is shared by the processes of one host);
* ``("fail", request_id, error)``: the engine refused a queued request;
* ``("dead", error)``: the loop failed; no request can make progress.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastdeploy.core.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

#: Seconds the loop waits for a command when it has nothing to step, or when its last step found
#: nothing to run while PD work (pulls, pending sends) goes on in the background.
IDLE_WAIT_S = 0.5


@dataclass(frozen=True)
class AddRequest:
    """Queue a request that already passed the admission check."""

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
Emit = Callable[..., None]


class EngineLoop:
    """Drives ``engine`` from ``commands`` until :class:`StopLoop`, emitting messages.

    Args:
        engine: an ``LLMEngine`` or a stand-in with ``add_request``, ``abort_request``,
            ``step``, ``has_unfinished_requests`` and ``get_stats`` (``has_background_work``,
            ``set_wakeup`` and ``last_step_idle`` when it has them).
        commands: where commands arrive (``get(timeout=)``, ``get_nowait()``, ``put()``); the
            engine's wake-up callback puts :class:`Wake` there.
        emit: called as ``emit(kind, *args)`` for each message (see the module docstring), on
            the loop's thread.
    """

    def __init__(self, engine: Any, commands: queue.SimpleQueue, emit: Emit) -> None:
        self.engine = engine
        self.commands = commands
        self.emit = emit

    def run(self) -> None:
        """Loop until :class:`StopLoop`; a failure is logged and emitted as ``dead``."""
        engine = self.engine
        background = getattr(engine, "has_background_work", lambda: False)
        set_wakeup = getattr(engine, "set_wakeup", None)
        if set_wakeup is not None:
            set_wakeup(lambda: self.commands.put(Wake()))
        try:
            self.emit("stats", engine.get_stats())
            while True:
                busy = engine.has_unfinished_requests() and not getattr(
                    engine, "last_step_idle", False
                )
                changed = self._drain(block=not busy)
                if changed is None:
                    return
                if engine.has_unfinished_requests() or background():
                    outputs = engine.step()
                    self.emit("step", outputs, engine.get_stats(), time.monotonic())
                elif changed:  # no step message will carry the counters (an abort when idle)
                    self.emit("stats", engine.get_stats())
        except BaseException as e:  # noqa: BLE001 - report any failure to the waiting clients
            logger.exception("engine loop failed")
            self.emit("dead", e)

    def _drain(self, block: bool) -> bool | None:
        """Apply queued commands; wait for one first when ``block``. Returns whether an add or
        an abort was applied, or None for :class:`StopLoop`."""
        changed = False
        while True:
            try:
                cmd: Command = (
                    self.commands.get(timeout=IDLE_WAIT_S) if block else self.commands.get_nowait()
                )
            except queue.Empty:
                break  # idle: let the loop check background work, then wait again
            block = False
            if isinstance(cmd, StopLoop):
                return None
            if isinstance(cmd, Wake):
                continue
            changed = True
            if isinstance(cmd, AddRequest):
                self._add(cmd)
            elif isinstance(cmd, AbortRequest):
                self.engine.abort_request(cmd.request_id)
        return changed

    def _add(self, cmd: AddRequest) -> None:
        try:
            if cmd.kv_transfer_params is None:
                self.engine.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.sampling_params)
            else:
                self.engine.add_request(
                    cmd.request_id,
                    cmd.prompt_token_ids,
                    cmd.sampling_params,
                    cmd.kv_transfer_params,
                )
        except ValueError as e:
            self.emit("fail", cmd.request_id, e)


class ThreadCore:
    """The engine loop on a daemon thread of this process, for
    :class:`~fastdeploy.engine.async_engine.AsyncLLMEngine`.

    Both threads share one GIL, so what the server's asyncio thread spends per step is taken
    from the engine's host time: with the small SmolLM2-135M model on an H200, whose step is
    host-bound, 64 streams were served at 11,141 output tok/s this way and 26,471 with the engine
    in its own process, against 37,998 offline (README, Benchmarks). The server's default is
    therefore :class:`~fastdeploy.engine.engine_core_proc.EngineCoreProcess`.

    Args:
        engine: what :class:`EngineLoop` drives; its attributes ``tokenizer``,
            ``max_model_len``, ``vocab_size`` (``max_model_len_note``, ``config`` and
            ``plan`` when it has them) and ``check_request`` are read by the server.
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len: int = engine.max_model_len
        self.max_model_len_note: str | None = getattr(engine, "max_model_len_note", None)
        self.vocab_size: int = engine.vocab_size
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def check_request(self, prompt_token_ids, sampling_params, kv_transfer_params=None) -> Any:
        """The engine's own ``check_request`` (pure, so safe off the engine thread)."""
        if kv_transfer_params is None:
            return self.engine.check_request(prompt_token_ids, sampling_params)
        return self.engine.check_request(prompt_token_ids, sampling_params, kv_transfer_params)

    def describe(self) -> dict:
        """``{"config": ..., "deployment_plan": ...}`` as dicts (empty for a stand-in without
        them)."""
        out = {}
        for key, name in (("config", "config"), ("deployment_plan", "plan")):
            value = getattr(self.engine, name, None)
            if value is not None:
                out[key] = value.to_dict()
        return out

    def start(self, emit: Emit, loop: asyncio.AbstractEventLoop) -> None:
        """Start the loop thread; each message becomes a call ``emit(kind, *args)`` on
        ``loop``'s thread (``call_soon_threadsafe``; dropped once that loop is closed)."""

        def post(kind: str, *args: Any) -> None:
            try:
                loop.call_soon_threadsafe(emit, kind, *args)
            except RuntimeError:  # the loop is closed
                pass

        engine_loop = EngineLoop(self.engine, self._commands, post)
        self._thread = threading.Thread(
            target=engine_loop.run, name="fastdeploy-engine", daemon=True
        )
        self._thread.start()

    def send(self, cmd: Command) -> None:
        """Queue a command for the loop (any thread)."""
        self._commands.put(cmd)

    @property
    def thread_id(self) -> int | None:
        """``threading`` ident of the loop thread (None before :meth:`start`)."""
        return None if self._thread is None else self._thread.ident

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def join(self, timeout_s: float) -> bool:
        """Wait for the loop to end after :class:`StopLoop`; True when it did."""
        if self._thread is not None:
            self._thread.join(timeout_s)
        return not self.is_alive()

    def close(self) -> None:
        """Release the engine (call after :meth:`join` returned True)."""
        self.engine.shutdown()

    def kill(self) -> None:
        """Nothing: a thread cannot be stopped inside a step, and releasing the model under it
        would be unsafe. It is a daemon, so it does not keep the process alive."""
