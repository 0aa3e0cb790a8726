"""The engine process's main: the engine half of the server's default (vLLM's engine core).

The server process keeps HTTP, tokenisation, chat templates and SSE encoding; the engine
process loads the model and runs :class:`~fastdeploy.engine.engine_loop.EngineLoop` (schedule,
step, detokenise, stop checks). Why: the two used to share one GIL, and for a small model whose
step is host-bound the server's per-token work came out of the engine's step time (SmolLM2-135M
on an H200, 64 streams, output tok/s: 11,141 with the engine on a thread, 26,471 in its own
process, 37,998 offline; README, Benchmarks). The server's half, which starts this process and
talks to it, is :mod:`fastdeploy.entrypoints.engine_client.process_client`.

Wire: two one-way pipes (``multiprocessing.Pipe``; the ``spawn`` start method, which CUDA
needs), carrying the typed messages of :mod:`fastdeploy.core.messages`, pickled. Commands
(``AddRequest``, ``AbortRequest``, ``StopLoop``) go down; the loop's messages (``EngineStats``,
``StepOutputs``, ``RequestFailed``, ``EngineDead``) come up, one per step. Before the loop starts
the engine process sends ``EngineReady`` (the :class:`~fastdeploy.engine.admission.Admission`
requests are checked against, the resolved config and deployment plan) or ``EngineStartFailed`` when
the engine could not start.

Several API server processes (``--api-server-count N``, vLLM's flag): each has its own two pipes,
and :class:`~fastdeploy.engine.frontend_router.FrontendRouter` in the engine process sends each
one its own requests' outputs.

Lifetime, on this side:

* the engine process ignores SIGINT and SIGTERM: a Ctrl-C or a service manager signals the
  whole process group, and the server must first finish its in-flight requests (graceful
  shutdown), then stop the engine with ``StopLoop``;
* if the server process dies, the command pipe reaches end-of-file and the engine process
  stops at its next step boundary, releasing the model (and its tensor-parallel ranks); with
  several API server processes, the one that died leaves (its requests are aborted) and the
  engine stops once all have.
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import signal
import threading
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from fastdeploy.core import cpu_threads
from fastdeploy.core.messages import (
    EngineDead,
    EngineMessage,
    EngineReady,
    EngineStartFailed,
    EngineStats,
    RequestFailed,
    StepOutputs,
    StopLoop,
    portable_error,
)
from fastdeploy.core.outputs import EngineOutputList
from fastdeploy.engine.engine_loop import Emit, EngineLoop

if TYPE_CHECKING:
    from fastdeploy.config import DeploymentPlan, FDConfig
    from fastdeploy.engine.frontend_router import CommandSink

logger = logging.getLogger(__name__)

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def run_engine_core(
    config: FDConfig,
    plan: DeploymentPlan,
    log_level: str,
    cmd_conn: Connection,
    out_conn: Connection,
    extra_frontends: list[tuple[Connection, Connection]] = (),
) -> None:
    """Main function of the engine process: build ``LLMEngine(config, plan)``, report
    :class:`EngineReady` (or :class:`EngineStartFailed`), run the loop until ``StopLoop`` or the
    server's end-of-file, then release the engine.

    ``cmd_conn``: the receiving end of the command pipe; ``out_conn``: the sending end of the
    message pipe (both closed here on return).

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
        emit: Emit = PipeEmitter(out_conn, commands)
        sinks: list[CommandSink] = [commands]
    else:
        from fastdeploy.engine.frontend_router import FrontendRouter

        outs = iter([out for _, out in pairs])
        emit = FrontendRouter(commands, lambda inbox: PipeEmitter(next(outs), inbox), len(pairs))
        sinks = emit.inboxes
    for index, ((conn, _), sink) in enumerate(zip(pairs, sinks, strict=True)):
        threading.Thread(
            target=pump_commands,
            args=(conn, sink, ready),
            name=f"fastdeploy-engine-commands-{index}",
            daemon=True,
        ).start()
    from fastdeploy.engine.engine import LLMEngine

    flush = getattr(emit, "close", lambda: None)  # the router's sending threads
    try:
        engine = LLMEngine(config, plan, freeze_heap=False)  # frozen once ready, below
    except BaseException as e:  # noqa: BLE001 - reported to the server, which prints it
        if not isinstance(e, (ValueError, OSError)):
            logger.exception("the engine failed to start")
        emit(EngineStartFailed(e))
        flush()
        return
    try:
        ready.set()
        emit(
            EngineReady(
                admission=engine.admission(),
                config=engine.config.to_dict(),
                deployment_plan=engine.plan.to_dict(),
                pid=os.getpid(),
                threads=cpu_threads.thread_settings(),
            )
        )
        # The counters before the freeze: /metrics and /v1/server_info have them from the first
        # scrape after /health (the loop sends them again once it runs).
        emit(EngineStats(engine.get_stats()))
        engine.freeze_heap()  # while the API server starts (its first request waits for it)
        EngineLoop(engine, commands, emit).run()
    finally:
        flush()
        engine.shutdown()
        for _, out in pairs:
            out.close()


def pump_commands(conn: Connection, commands: CommandSink, ready: threading.Event) -> None:
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


class PipeEmitter:
    """Sends the loop's messages up the pipe (an :data:`~fastdeploy.core.messages.Emit`).

    An error that does not pickle (an exception type defined without pickling in mind) is sent
    as :func:`~fastdeploy.core.messages.portable_error` makes it; a closed pipe (the server is
    gone) stops the loop. A :class:`~fastdeploy.core.messages.StepOutputs`'s outputs go as an
    :class:`~fastdeploy.core.outputs.EngineOutputList` (one list of field tuples in the pickle;
    the server unpickles a plain list of outputs).

    Args:
        conn: the sending end of the message pipe.
        commands: where :class:`~fastdeploy.core.messages.StopLoop` goes when the pipe is closed
            (``put``).
    """

    def __init__(self, conn: Connection, commands: CommandSink) -> None:
        self.conn = conn
        self.commands = commands
        self.closed = False

    def __call__(self, message: EngineMessage) -> None:
        if self.closed:
            return
        match message:
            case StepOutputs(outputs, stats, now):
                message = StepOutputs(EngineOutputList(outputs), stats, now)
            case RequestFailed(request_id, error):
                message = RequestFailed(request_id, portable_error(error))
            case EngineDead(error):
                message = EngineDead(portable_error(error))
            case EngineStartFailed(error):
                message = EngineStartFailed(portable_error(error))
        try:
            try:
                self.conn.send(message)
            except (pickle.PicklingError, TypeError, AttributeError):
                if not isinstance(message, StepOutputs):
                    raise
                for output in message.outputs:
                    if output.error is not None:
                        output.error = portable_error(output.error)
                self.conn.send(message)
        except OSError:
            self.closed = True
            self.commands.put(StopLoop())
