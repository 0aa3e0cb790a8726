"""The API server's side of the engine in a process of its own (the server's default).

:class:`EngineCoreProcess` starts the engine process
(:func:`~fastdeploy.engine.engine_core_proc.run_engine_core`) and talks to it;
:class:`EngineCoreClient` is one API server's connection to it (with ``--api-server-count N``,
the processes after the first attach to the engine the first one started). Both are used by
:class:`~.async_engine.AsyncLLMEngine` like :class:`~.thread_core.ThreadCore`. The wire carries
the typed messages of :mod:`fastdeploy.core.messages`: commands go down, the loop's messages
come up, read here by :class:`~.pipe_frames.FrameReader`.

One of the two launchers of the engine on the server's side (with :mod:`.thread_core`): it may
import the engine process's main, :func:`~fastdeploy.engine.engine_core_proc.run_engine_core`.

Lifetime, on this side:

* if the engine process dies, the reply pipe reaches end-of-file (or, for the process that
  started it, its process sentinel becomes readable) and the server fails the in-flight
  requests with ``EngineDeadError`` and answers ``/health`` with 503; it does not restart the
  engine;
* the server stops the engine with ``StopLoop`` after its graceful shutdown; a front end that
  did not start the engine only leaves.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from fastdeploy.core.cpu_threads import ThreadSettings
from fastdeploy.core.messages import (
    AdmissionCheck,
    Command,
    Emit,
    EngineDead,
    EngineReady,
    EngineStartFailed,
    StopLoop,
)
from fastdeploy.core.sampling_params import SamplingParams
from fastdeploy.entrypoints.engine_client.pipe_frames import FrameReader

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from fastdeploy.config import DeploymentPlan, FDConfig

logger = logging.getLogger(__name__)

#: Seconds between liveness checks of the engine process while it starts.
STARTUP_POLL_S = 0.5


class EngineStartError(RuntimeError):
    """The engine process exited before it was ready (its log says why)."""


class EngineProcessExitedError(RuntimeError):
    """The engine process exited while serving (killed, or crashed outside Python)."""


class EngineCoreClient:
    """One API server's connection to an engine process: the commands it sends and the loop's
    messages it reads, used by :class:`~.async_engine.AsyncLLMEngine` like
    :class:`~.thread_core.ThreadCore`.

    Built directly, it attaches to an engine process that another process started: an API
    server process after the first with ``--api-server-count N`` (its pipes come from
    :attr:`EngineCoreProcess.extra_frontends`); leaving (``StopLoop``) then ends only this front
    end's part (the engine process aborts the requests it still had), and :meth:`join` returns
    at once. :class:`EngineCoreProcess` is the same connection for the process that started the
    engine. The constructor returns once the engine has reported ready; meanwhile this process
    loads the tokenizer.

    Args:
        config: the resolved config the engine process runs (for the tokenizer).
        cmd_conn: the sending end of this front end's command pipe.
        out_conn: the receiving end of its message pipe.

    Raises:
        ValueError, FileNotFoundError, OSError: what ``LLMEngine`` raised in the engine process.
        EngineStartError: the engine process died while starting (or its pipe closed).
    """

    def __init__(self, config: FDConfig, cmd_conn: Connection, out_conn: Connection) -> None:
        self._attach(config, cmd_conn, out_conn)

    def _attach(self, config: FDConfig, cmd_conn: Connection, out_conn: Connection) -> None:
        """Take the pipes, load the tokenizer and wait for the engine's
        :class:`~fastdeploy.core.messages.EngineReady` (on failure: :meth:`kill`, then raise)."""
        self._cmd, self._out = cmd_conn, out_conn
        self._send_lock = threading.Lock()
        self._stopping = False
        self._reading = False
        self._watching: int | None = None
        self._lost_reported = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._emit: Emit | None = None
        #: Called (on the loop's thread) after ``EngineDead`` when the pipe from the engine closes
        #: without a StopLoop from here: the engine process ended, or cut this front end off.
        self.on_engine_lost: Callable[[], None] | None = None
        try:
            self._connect(config)
        except BaseException:
            self.kill()
            raise

    def _connect(self, config: FDConfig) -> None:
        self.tokenizer: PreTrainedTokenizerBase | None = None
        if not config.model_config.skip_tokenizer_init:
            self.tokenizer = config.model_source.load_tokenizer()
        ready = self._wait_ready()
        self.admission: AdmissionCheck = ready.admission
        self.max_model_len: int = self.admission.max_model_len
        self.max_model_len_note: str | None = self.admission.max_model_len_note
        self.vocab_size: int = self.admission.vocab_size
        #: The engine process's pid (for ``/v1/server_info``: what to watch or signal).
        self.engine_pid: int | None = ready.pid
        self._describe = {"config": ready.config, "deployment_plan": ready.deployment_plan}
        #: The engine process's :class:`~fastdeploy.core.cpu_threads.ThreadSettings`.
        self.engine_threads: ThreadSettings = ready.threads

    def _engine_alive(self) -> bool:
        """Whether the engine process may still answer (its own process can tell; a front end
        that did not start it learns of its end from the pipe)."""
        return True

    def _exit_note(self) -> str:
        return "the engine process exited"

    def _wait_ready(self) -> EngineReady:
        while not self._out.poll(STARTUP_POLL_S):
            if not self._engine_alive():
                raise EngineStartError(f"{self._exit_note()} while starting (its log is above)")
        try:
            message = self._out.recv()
        except (EOFError, OSError):
            raise EngineStartError(
                f"{self._exit_note()} while starting (its log is above)"
            ) from None
        match message:
            case EngineReady():
                return message
            case EngineStartFailed(error):
                self._started_with_error()
                raise error
        raise EngineStartError(f"the engine process sent {message!r} before it was ready")

    def _started_with_error(self) -> None:
        """The engine reported a start-up error (its process then exits by itself)."""

    # ------------------------------------------------------------------ server side
    def check_request(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        kv_transfer_params: dict | None = None,
    ) -> Any:
        """:meth:`Admission.check` with the engine's start-up values, in this process."""
        return self.admission.check(prompt_token_ids, sampling_params, kv_transfer_params)

    @property
    def splitwise_role(self) -> str:
        """The engine's PD role: ``mixed``, ``prefill`` or ``decode``."""
        return self.admission.splitwise_role

    def release_refused_leg(self, params: object) -> bool:
        """A decode leg was refused before admission: free its prefill node's blocks now
        (``fastdeploy.splitwise.legs.release_refused_leg``, with the trusted prefill nodes of
        this node's admission). Returns whether an ABORT was started."""
        return self.admission.release_refused_leg(params)

    def describe(self) -> dict:
        """``{"config": ..., "deployment_plan": ...}`` as the engine process runs them."""
        return dict(self._describe)

    def start(self, emit: Emit, loop: asyncio.AbstractEventLoop) -> None:
        """Read the engine's messages on ``loop`` (its thread calls ``emit(message)`` for each
        one, and ``emit(EngineDead(error))`` when the engine process ends other than by
        :meth:`send` of ``StopLoop``). The asyncio thread reads the pipe itself when it is
        readable, through :class:`~.pipe_frames.FrameReader` (a message larger
        than the pipe's buffer arrives over several wake-ups): a reader thread would have to
        take the GIL from the asyncio thread for every step (up to the 5 ms switch interval
        while that thread encodes streams) and then hand each message over.

        The engine is declared dead on end-of-file of the pipe, or (for the process that
        started it) when its process exits, and on nothing else: a read that finds no data
        yet is not an end."""
        self._loop = loop
        self._emit = emit
        self._frames = FrameReader(self._out.fileno())
        loop.add_reader(self._out.fileno(), self._on_readable)
        self._reading = True
        sentinel = self._sentinel()
        if sentinel is not None:
            loop.add_reader(sentinel, self._on_exit)
            self._watching = sentinel

    def _sentinel(self) -> int | None:
        """A descriptor that becomes readable when the engine process exits (None: only the
        pipe can tell)."""
        return None

    def _on_readable(self) -> None:
        try:
            messages, eof = self._frames.read()
        except OSError as e:  # EBADF and the like: this end cannot read the pipe any more
            logger.error("reading the engine's pipe failed: %s", e)
            messages, eof = [], True
        for message in messages:
            self._emit(message)
        if eof:
            self._lost()

    def _on_exit(self) -> None:
        """The engine process exited: read what it sent before it did, then report it."""
        self._unwatch()
        if self._reading:
            self._on_readable()
        self._lost()

    def _lost(self) -> None:
        self._stop_reading()
        self._unwatch()
        if not self._stopping and not self._lost_reported:
            self._lost_reported = True
            self._emit(EngineDead(EngineProcessExitedError(self._exit_note())))
            if self.on_engine_lost is not None:
                self.on_engine_lost()

    def _unwatch(self) -> None:
        if self._watching is not None:
            self._loop.remove_reader(self._watching)
            self._watching = None

    def _stop_reading(self) -> None:
        if self._reading:
            self._reading = False
            self._loop.remove_reader(self._out.fileno())

    def send(self, cmd: Command) -> None:
        """Send a command (any thread). Dropped when the engine process is gone: the reader
        reports that."""
        if isinstance(cmd, StopLoop):
            self._stopping = True
        try:
            with self._send_lock:
                self._cmd.send(cmd)
        except (OSError, ValueError):  # a closed pipe, or the process already exited
            pass

    def is_alive(self) -> bool:
        return self._reading and self._engine_alive()

    def join(self, timeout_s: float) -> bool:
        """After ``StopLoop``: True at once (this front end has left; the engine process runs
        on for the others, or stops once the last has left)."""
        return True

    def close(self) -> None:
        """Stop reading and close the pipes (after :meth:`join`; on the loop's thread)."""
        self._stopping = True
        self._stop_reading()
        if self._loop is not None:
            self._unwatch()
        self._cmd.close()
        self._out.close()

    def kill(self) -> None:
        """Leave at once: close the pipes (the engine process aborts this front end's
        requests when it sees them close)."""
        self.close()


class EngineCoreProcess(EngineCoreClient):
    """Starts the engine process and talks to it (as :class:`EngineCoreClient`).

    The constructor returns once the engine is ready (model loaded, KV cache sized, graphs
    captured); meanwhile this process loads the tokenizer.

    Args:
        config: a resolved config (``EngineArgs.create_engine_config``); pickled to the engine
            process.
        plan: its deployment plan (``fastdeploy.config.resolve.resolve_deployment``).
        log_level: the engine process's logging level (``info``, ``debug``, ...).
        num_frontends: API server processes the engine serves (``--api-server-count``): this
            one, plus ``num_frontends - 1`` whose pipes are in :attr:`extra_frontends`.

    Raises:
        ValueError, FileNotFoundError, OSError: what ``LLMEngine`` raised in the engine process
            (a bad setting, a missing model, a KV pool too small); ValueError also for
            ``num_frontends`` < 1.
        EngineStartError: the engine process died while starting.
    """

    def __init__(
        self,
        config: FDConfig,
        plan: DeploymentPlan,
        log_level: str = "info",
        num_frontends: int = 1,
    ) -> None:
        if num_frontends < 1:
            raise ValueError(f"num_frontends={num_frontends} is invalid; allowed: >= 1")
        from fastdeploy.engine.engine_core_proc import run_engine_core  # the launcher's exception

        ctx = multiprocessing.get_context("spawn")
        cmd_recv, cmd_send = ctx.Pipe(duplex=False)
        out_recv, out_send = ctx.Pipe(duplex=False)
        extra = [(ctx.Pipe(duplex=False), ctx.Pipe(duplex=False)) for _ in range(num_frontends - 1)]
        #: ``(cmd_conn, out_conn)`` of each other front end, for :class:`EngineCoreClient`
        #: in its process; :meth:`release_extra_frontends` closes this process's copies.
        self.extra_frontends = [(c_send, o_recv) for (_, c_send), (o_recv, _) in extra]
        self.proc = ctx.Process(
            target=run_engine_core,
            args=(config, plan, log_level, cmd_recv, out_send),
            kwargs={"extra_frontends": [(c_recv, o_send) for (c_recv, _), (_, o_send) in extra]},
            name="fastdeploy-engine-core",
        )
        # Inherits OMP_WAIT_POLICY=PASSIVE (fastdeploy.core.cpu_threads: set on import).
        self.proc.start()
        for conn in [cmd_recv, out_send] + [c for pair in extra for c in (pair[0][0], pair[1][1])]:
            conn.close()
        self._attach(config, cmd_send, out_recv)
        logger.info("engine process %d is ready", self.proc.pid)

    def _engine_alive(self) -> bool:
        return self.proc.is_alive()

    def _sentinel(self) -> int | None:
        return self.proc.sentinel

    def _started_with_error(self) -> None:
        self.proc.join(10)  # it exits by itself: let it, before kill() would

    def _exit_note(self) -> str:
        self.proc.join(1)
        return f"the engine process exited (code {self.proc.exitcode})"

    def release_extra_frontends(self) -> None:
        """Close this process's copies of the other front ends' pipes (once their processes
        hold them), so that the engine process sees a pipe close when its front end dies."""
        for cmd_conn, out_conn in self.extra_frontends:
            cmd_conn.close()
            out_conn.close()
        self.extra_frontends = []

    def join(self, timeout_s: float) -> bool:
        """Wait for the engine process to exit after ``StopLoop`` (with several front ends, it
        exits once every one has left); True when it did."""
        self.proc.join(timeout_s)
        return not self.proc.is_alive()

    def kill(self) -> None:
        """End the engine process now (SIGKILL; it ignores SIGTERM) and close the pipes."""
        self._stopping = True
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)
        self.release_extra_frontends()
        self.close()
