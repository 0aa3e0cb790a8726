"""The loop that drives an engine in the engine process (or on a thread of the API server).

:class:`EngineLoop` drains commands (adds, aborts) between steps, steps while there is work, and
emits each step's outputs and stats as messages. It never waits on HTTP. While the engine captures
CUDA graphs in the background (``graph_capture_pending()``, optional), an idle loop captures one
graph (``capture_next_graph()``) per turn instead of waiting for a command, and emits the
progress; a busy one leaves the capture to ``step()``, which paces it. The same loop runs

* in a process of its own (the default of the server; :mod:`~fastdeploy.engine.engine_core_proc`),
  where the messages travel over a pipe, or
* on a thread of the server process
  (:class:`~fastdeploy.entrypoints.engine_client.thread_core.ThreadCore`;
  ``--disable-frontend-multiprocessing`` and the tests' stand-in engines), where they are posted
  to the asyncio loop directly.

Commands and messages are the typed ones of :mod:`fastdeploy.core.messages`, handled by
:class:`~fastdeploy.entrypoints.engine_client.async_engine.AsyncLLMEngine`:

* :class:`~fastdeploy.core.messages.EngineStats`: the engine's counters
  (``LLMEngine.get_stats``), at start and after commands that no step follows (a step's own
  message carries them otherwise);
* :class:`~fastdeploy.core.messages.StepOutputs`: one step's ``EngineOutput`` list, the counters
  after it and the ``time.monotonic()`` it ended (the clock is shared by the processes of one
  host);
* :class:`~fastdeploy.core.messages.RequestFailed`: the engine refused a queued request;
* :class:`~fastdeploy.core.messages.EngineDead`: the loop failed; no request can make progress.
"""

from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from fastdeploy.core.messages import (
    AbortRequest,
    AddRequest,
    Emit,
    EngineDead,
    EngineStats,
    RequestFailed,
    StepOutputs,
    StopLoop,
)
from fastdeploy.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from fastdeploy.core.outputs import EngineOutput

logger = logging.getLogger(__name__)

#: Seconds the loop waits for a command when it has nothing to step, or when its last step found
#: nothing to run while PD work (pulls, pending sends) goes on in the background.
IDLE_WAIT_S = 0.5


@dataclass(frozen=True)
class Wake:
    """Step again now: background work ended (a PD pull finished)."""


#: What the loop's queue holds: the server's commands, and the engine's own wake-ups.
Command = AddRequest | AbortRequest | StopLoop | Wake


class SteppableEngine(Protocol):
    """What :class:`EngineLoop` drives (``LLMEngine``, or a test's stand-in). Optional, read
    with ``getattr``: ``graph_capture_pending()`` and ``capture_next_graph()`` (the background
    graph capture), ``has_background_work()`` (PD pulls or sends going on), ``set_wakeup(fn)``
    (``fn`` is called from another thread when that work ends) and ``last_step_idle`` (the last
    step found nothing to run)."""

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        kv_transfer_params: dict | None = None,
    ) -> None:
        """Queue a request; ``ValueError`` when the engine refuses it."""

    def abort_request(self, request_id: str) -> None:
        """Abort a request (a no-op for an unknown id)."""

    def step(self) -> list[EngineOutput]:
        """Run one step; its outputs."""

    def has_unfinished_requests(self) -> bool:
        """Whether any request runs or waits."""

    def get_stats(self) -> dict:
        """The counters (:class:`~fastdeploy.core.messages.EngineStats`)."""


#: A queue of :data:`Command` (``get(timeout=)``, ``get_nowait()``, ``put()``).
CommandQueue = queue.SimpleQueue


class EngineLoop:
    """Drives ``engine`` from ``commands`` until :class:`StopLoop`, emitting messages.

    Args:
        engine: an ``LLMEngine`` or a stand-in (:class:`SteppableEngine`).
        commands: where commands arrive (``get(timeout=)``, ``get_nowait()``, ``put()``); the
            engine's wake-up callback puts :class:`Wake` there.
        emit: called with each message (see the module docstring), on the loop's thread.
    """

    def __init__(self, engine: SteppableEngine, commands: CommandQueue, emit: Emit) -> None:
        self.engine = engine
        self.commands = commands
        self.emit = emit

    def run(self) -> None:
        """Loop until :class:`StopLoop`; a failure is logged and emitted as :class:`EngineDead`."""
        engine = self.engine
        background = getattr(engine, "has_background_work", lambda: False)
        capture_pending = getattr(engine, "graph_capture_pending", lambda: False)
        set_wakeup = getattr(engine, "set_wakeup", None)
        if set_wakeup is not None:
            set_wakeup(lambda: self.commands.put(Wake()))
        try:
            self.emit(EngineStats(engine.get_stats()))
            while True:
                busy = engine.has_unfinished_requests() and not getattr(
                    engine, "last_step_idle", False
                )
                capturing = capture_pending()
                changed = self._drain(block=not busy and not capturing)
                if changed is None:
                    return
                if engine.has_unfinished_requests() or background():
                    outputs = engine.step()  # captures a graph first when its pacer allows
                    self.emit(StepOutputs(outputs, engine.get_stats(), time.monotonic()))
                elif capturing:  # idle: capture one graph, then look for commands again
                    engine.capture_next_graph()
                    self.emit(EngineStats(engine.get_stats()))  # the capture's progress
                elif changed:  # no step message will carry the counters (an abort when idle)
                    self.emit(EngineStats(engine.get_stats()))
        except BaseException as e:  # noqa: BLE001 - report any failure to the waiting clients
            logger.exception("engine loop failed")
            self.emit(EngineDead(e))

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
            self.emit(RequestFailed(cmd.request_id, e))
