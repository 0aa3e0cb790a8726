"""The engine in a process of its own, the API server's default (vLLM's engine core).

The server process keeps HTTP, tokenisation, chat templates and SSE encoding; the engine
process loads the model and runs :class:`~fastdeploy.engine.engine_loop.EngineLoop` (schedule,
step, detokenise, stop checks). Why: the two used to share one GIL, and for a small model whose
step is host-bound the server's per-token work came out of the engine's step time (SmolLM2-135M
on an H200, 64 streams, output tok/s: 11,141 with the engine on a thread, 26,471 in its own
process, 37,998 offline; README, Benchmarks).

Wire: two one-way pipes (``multiprocessing.Pipe``; the ``spawn`` start method, which CUDA
needs). Commands (``AddRequest``, ``AbortRequest``, ``StopLoop``) go down; the loop's messages
(``stats``, ``step``, ``fail``, ``dead``) come up, one per step, pickled. Before the loop starts
the engine process sends ``("ready", info)`` (the :class:`~fastdeploy.engine.admission.Admission`
requests are checked against, the resolved config and graph plan) or ``("error", exception)``
when the engine could not start.

Several API server processes (``--api-server-count N``, vLLM's flag): each has its own two pipes
(:attr:`EngineCoreProcess.extra_frontends` for those after the first, which attach with
:class:`EngineCoreClient`), and :class:`~fastdeploy.engine.frontend_router.FrontendRouter` in the
engine process sends each one its own requests' outputs.

Lifetime:

* the engine process ignores SIGINT and SIGTERM: a Ctrl-C or a service manager signals the
  whole process group, and the server must first finish its in-flight requests (graceful
  shutdown), then stop the engine with ``StopLoop``;
* if the server process dies, the command pipe reaches end-of-file and the engine process
  stops at its next step boundary, releasing the model (and its tensor-parallel ranks); with
  several API server processes, the one that died leaves (its requests are aborted) and the
  engine stops once all have;
* if the engine process dies, the reply pipe reaches end-of-file and the server fails the
  in-flight requests with ``EngineDeadError`` and answers ``/health`` with 503; it does not
  restart the engine.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import pickle
import queue
import signal
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastdeploy.core import cpu_threads
from fastdeploy.core.outputs import EngineOutputList
from fastdeploy.engine.engine_loop import Command, Emit, EngineLoop, StopLoop
from fastdeploy.engine.pipe_frames import FrameReader

if TYPE_CHECKING:
    from fastdeploy.config import FDConfig
    from fastdeploy.model_executor.graph_optimization.policy import GraphPlan

logger = logging.getLogger(__name__)

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
#: Seconds between liveness checks of the engine process while it starts.
STARTUP_POLL_S = 0.5


class EngineStartError(RuntimeError):
    """The engine process exited before it was ready (its log says why)."""


class EngineProcessExitedError(RuntimeError):
    """The engine process exited while serving (killed, or crashed outside Python)."""


def portable_error(error: BaseException) -> BaseException:
    """``error`` when it survives pickling, else a ``RuntimeError`` naming its type and text."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any pickling failure
        return RuntimeError(f"{type(error).__name__}: {error}")


class EngineCoreClient:
    """One API server's connection to an engine process: the commands it sends and the loop's
    messages it reads, used by :class:`~fastdeploy.engine.async_engine.AsyncLLMEngine` like
    :class:`~fastdeploy.engine.engine_loop.ThreadCore`.

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

    def __init__(self, config: FDConfig, cmd_conn: Any, out_conn: Any) -> None:
        self._attach(config, cmd_conn, out_conn)

    def _attach(self, config: FDConfig, cmd_conn: Any, out_conn: Any) -> None:
        """Take the pipes, load the tokenizer and wait for the engine's ``ready`` (on failure:
        :meth:`kill`, then raise)."""
        self._cmd, self._out = cmd_conn, out_conn
        self._send_lock = threading.Lock()
        self._stopping = False
        self._reading = False
        self._watching: int | None = None
        self._lost_reported = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._emit: Emit | None = None
        #: Called (on the loop's thread) after ``dead`` when the pipe from the engine closes
        #: without a StopLoop from here: the engine process ended, or cut this front end off.
        self.on_engine_lost: Callable[[], None] | None = None
        try:
            self._connect(config)
        except BaseException:
            self.kill()
            raise

    def _connect(self, config: FDConfig) -> None:
        self.tokenizer = None
        if not config.model_config.skip_tokenizer_init:
            self.tokenizer = config.model_source.load_tokenizer()
        info = self._wait_ready()
        self.admission = info["admission"]
        self.max_model_len: int = self.admission.max_model_len
        self.max_model_len_note: str | None = self.admission.max_model_len_note
        self.vocab_size: int = self.admission.vocab_size
        #: The engine process's pid (for ``/v1/server_info``: what to watch or signal).
        self.engine_pid: int | None = info.get("pid")
        self._describe = {"config": info["config"], "graph_plan": info["graph_plan"]}
        #: The engine process's :class:`~fastdeploy.core.cpu_threads.ThreadSettings`.
        self.engine_threads: cpu_threads.ThreadSettings = info["threads"]

    def _engine_alive(self) -> bool:
        """Whether the engine process may still answer (its own process can tell; a front end
        that did not start it learns of its end from the pipe)."""
        return True

    def _exit_note(self) -> str:
        return "the engine process exited"

    def _wait_ready(self) -> dict:
        while not self._out.poll(STARTUP_POLL_S):
            if not self._engine_alive():
                raise EngineStartError(f"{self._exit_note()} while starting (its log is above)")
        try:
            kind, payload = self._out.recv()
        except (EOFError, OSError):
            raise EngineStartError(
                f"{self._exit_note()} while starting (its log is above)"
            ) from None
        if kind == "error":
            self._started_with_error()
            raise payload
        return payload

    def _started_with_error(self) -> None:
        """The engine reported a start-up error (its process then exits by itself)."""

    # ------------------------------------------------------------------ server side
    def check_request(self, prompt_token_ids, sampling_params, kv_transfer_params=None) -> Any:
        """:meth:`Admission.check` with the engine's start-up values, in this process."""
        return self.admission.check(prompt_token_ids, sampling_params, kv_transfer_params)

    def describe(self) -> dict:
        """``{"config": ..., "graph_plan": ...}`` as the engine process resolved them."""
        return dict(self._describe)

    def start(self, emit: Emit, loop: asyncio.AbstractEventLoop) -> None:
        """Read the engine's messages on ``loop`` (its thread calls ``emit(kind, *args)`` for
        each one, and ``emit("dead", error)`` when the engine process ends other than by
        :meth:`send` of ``StopLoop``). The asyncio thread reads the pipe itself when it is
        readable, through :class:`~fastdeploy.engine.pipe_frames.FrameReader` (a message larger
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
            self._emit(*message)
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
            self._emit("dead", EngineProcessExitedError(self._exit_note()))
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
        graph_plan: its graph plan.
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
        graph_plan: GraphPlan,
        log_level: str = "info",
        num_frontends: int = 1,
    ) -> None:
        if num_frontends < 1:
            raise ValueError(f"num_frontends={num_frontends} is invalid; allowed: >= 1")
        ctx = multiprocessing.get_context("spawn")
        cmd_recv, cmd_send = ctx.Pipe(duplex=False)
        out_recv, out_send = ctx.Pipe(duplex=False)
        extra = [(ctx.Pipe(duplex=False), ctx.Pipe(duplex=False)) for _ in range(num_frontends - 1)]
        #: ``(cmd_conn, out_conn)`` of each other front end, for :class:`EngineCoreClient`
        #: in its process; :meth:`release_extra_frontends` closes this process's copies.
        self.extra_frontends = [(c_send, o_recv) for (_, c_send), (o_recv, _) in extra]
        self.proc = ctx.Process(
            target=run_engine_core,
            args=(config, graph_plan, log_level, cmd_recv, out_send),
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


# ---------------------------------------------------------------------- engine process
def run_engine_core(
    config: FDConfig,
    graph_plan: GraphPlan,
    log_level: str,
    cmd_conn: Any,
    out_conn: Any,
    extra_frontends: list[tuple[Any, Any]] = (),
) -> None:
    """Main function of the engine process: build ``LLMEngine(config, graph_plan)``, report
    ``ready`` (or ``error``), run the loop until ``StopLoop`` or the server's end-of-file, then
    release the engine.

    ``extra_frontends``: ``(cmd_conn, out_conn)`` of each further API server process
    (``--api-server-count``); with any, the messages are routed by
    :class:`~fastdeploy.engine.frontend_router.FrontendRouter` and the loop stops once every
    front end has left."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level.upper(), format=LOG_FORMAT)
    commands: queue.SimpleQueue = queue.SimpleQueue()
    ready = threading.Event()
    pairs = [(cmd_conn, out_conn), *extra_frontends]
    if len(pairs) == 1:
        emit: Emit = _Emitter(out_conn, commands)
        sinks: list[Any] = [commands]
    else:
        from fastdeploy.engine.frontend_router import FrontendRouter

        outs = iter([out for _, out in pairs])
        emit = FrontendRouter(commands, lambda inbox: _Emitter(next(outs), inbox), len(pairs))
        sinks = emit.inboxes
    for index, ((conn, _), sink) in enumerate(zip(pairs, sinks, strict=True)):
        threading.Thread(
            target=_pump,
            args=(conn, sink, ready),
            name=f"fastdeploy-engine-commands-{index}",
            daemon=True,
        ).start()
    from fastdeploy.engine.engine import LLMEngine

    flush = getattr(emit, "close", lambda: None)  # the router's sending threads
    try:
        engine = LLMEngine(config, graph_plan)
    except BaseException as e:  # noqa: BLE001 - reported to the server, which prints it
        if not isinstance(e, (ValueError, OSError)):
            logger.exception("the engine failed to start")
        emit("error", portable_error(e))
        flush()
        return
    try:
        ready.set()
        emit(
            "ready",
            {
                "admission": engine.admission(),
                "config": engine.config.to_dict(),
                "graph_plan": engine.graph_plan.to_dict(),
                "pid": os.getpid(),
                "threads": cpu_threads.thread_settings(),
            },
        )
        EngineLoop(engine, commands, emit).run()
    finally:
        flush()
        engine.shutdown()
        for _, out in pairs:
            out.close()


def _pump(conn: Any, commands: Any, ready: threading.Event) -> None:
    """Move commands from the pipe to the loop's queue (or to a front end's inbox of the
    router). End-of-file (the server is gone) stops the loop (with several front ends: that
    one leaves), or, before the engine is ready, ends the process at once: no request can be in
    flight, and loading a large model to completion would hold its GPU memory for nothing (its
    tensor-parallel ranks exit with it)."""
    while True:
        try:
            cmd = conn.recv()
        except (EOFError, OSError):
            if not ready.is_set():
                logger.error("the server process is gone before the engine was ready; exiting")
                os._exit(1)
            commands.put(StopLoop())
            return
        commands.put(cmd)


class _Emitter:
    """Sends the loop's messages up the pipe. A message that does not pickle (an exception
    type defined without pickling in mind) is sent again with its errors made portable; a
    closed pipe (the server is gone) stops the loop. A ``step`` message's outputs go as an
    :class:`~fastdeploy.core.outputs.EngineOutputList` (one list of field tuples in the pickle;
    the server unpickles a plain list of outputs)."""

    def __init__(self, conn: Any, commands: Any) -> None:
        # commands: where StopLoop goes when the pipe is closed (``put``)
        self.conn = conn
        self.commands = commands
        self.closed = False

    def __call__(self, kind: str, *args: Any) -> None:
        if self.closed:
            return
        if kind in ("fail", "dead", "error"):
            args = (*args[:-1], portable_error(args[-1]))
        elif kind == "step":
            args = (EngineOutputList(args[0]), *args[1:])
        try:
            try:
                self.conn.send((kind, *args))
            except (pickle.PicklingError, TypeError, AttributeError):
                if kind != "step":
                    raise
                for output in args[0]:
                    if output.error is not None:
                        output.error = portable_error(output.error)
                self.conn.send((kind, *args))
        except OSError:
            self.closed = True
            self.commands.put(StopLoop())
