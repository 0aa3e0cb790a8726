"""Several API server processes in front of one engine process (``--api-server-count N``, vLLM's
flag and its design).

Why: with many concurrent streams, one server process's asyncio thread does all the HTTP work (a
socket write per streamed token per stream, each request's parsing and validation), and where
that thread is saturated it becomes the queue that new requests and their first tokens wait in.
With N processes that work is spread over N cores, all serving the same port. (Measured on one
H200 host with SmolLM2-135M, 64 streams, 1 / 2 / 4 processes twice each: 31,328-35,116 /
33,242-34,789 / 25,804-33,067 output tok/s, TTFT p50 15-22 ms throughout; there the thread was
not the bottleneck.)

How:

* the first process (the one started from the command line) starts the engine process with N
  pairs of pipes
  (:class:`~fastdeploy.entrypoints.engine_client.process_client.EngineCoreProcess`), binds the
  listening socket, and starts N - 1 more API server processes (:class:`APIServerWorkers`),
  each given the socket, its pipes and a lifeline pipe; all N accept connections from the one
  socket and serve them alike;
* each process admits up to its share of ``--max-concurrency`` (:func:`concurrency_share`);
* metrics: each process records its own requests, the first one also the engine's counters,
  in prometheus_client's multiprocess files (``PROMETHEUS_MULTIPROC_DIR``), so ``/metrics`` from
  any process gives the whole server's numbers.

Lifetime:

* SIGINT/SIGTERM go to the first process, which stops the others (SIGTERM) as its own graceful
  shutdown starts and waits for them before it stops the engine; the others start with SIGINT
  blocked, so a Ctrl-C that reaches the whole process group is handled once;
* if the first process dies, the others see their lifeline close and shut down gracefully;
* if another process dies, or leaves its messages unread for 10 s (hung:
  ``frontend_router.STUCK_S``), the engine process aborts its requests (their KV blocks are
  freed) and the rest serve on; the first process logs it; a process after the first that loses
  the engine (cut off, or the engine died) shuts itself down, so the first one alone answers 503
  when the engine is gone.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import signal
import threading
import time
from multiprocessing.connection import wait
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import socket
    from collections.abc import Callable

    from fastdeploy.config import FDConfig

logger = logging.getLogger("fastdeploy.api_server")


def concurrency_share(total: int, count: int, index: int) -> int:
    """API server ``index``'s share of ``--max-concurrency`` ``total`` over ``count``
    processes: equal parts, the remainder to the first ones (never below 1).

    Raises:
        ValueError: ``count`` < 1 or ``index`` outside ``0..count-1``.
    """
    if count < 1 or not 0 <= index < count:
        raise ValueError(f"index={index}, count={count} is invalid; allowed: 0 <= index < count")
    return max(1, total // count + (1 if index < total % count else 0))


class APIServerWorkers:
    """The API server processes after the first: started here, stopped by :meth:`stop`.

    Args:
        args: the server's parsed arguments (pickled to each process).
        config: the resolved config (for the tokenizer).
        frontends: ``(cmd_conn, out_conn)`` per process (``EngineCoreProcess.extra_frontends``).
        sock: the bound, listening socket.
        serve: the HTTP layer each process runs
            (:func:`fastdeploy.entrypoints.openai.api_server.serve`, a module-level function:
            the spawn start method pickles it by name).
    """

    def __init__(
        self,
        args: argparse.Namespace,
        config: FDConfig,
        frontends: list[tuple[Any, Any]],
        sock: socket.socket,
        serve: Callable[..., None],
    ) -> None:
        ctx = multiprocessing.get_context("spawn")
        count = len(frontends) + 1
        self.procs: list[Any] = []
        self._lifelines: list[Any] = []
        self._stopping = False
        # They start with SIGINT blocked (the signal mask is inherited through exec), so a
        # Ctrl-C that reaches the whole group is the first process's alone, even while they
        # import; here it is only held back until they have started. The mask is this thread's
        # alone: another thread of this process can still take the signal, and Python would
        # then raise KeyboardInterrupt here, possibly half way through writing a child's
        # start-up data (the child then failed with "EOFError: Ran out of input"). So the
        # Python handler is deferred too, and a Ctrl-C raises once every child has started.
        interrupted: list[int] = []
        try:
            previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            main = threading.current_thread() is threading.main_thread()
            if main:  # signal.signal works on the main thread only
                handler = signal.signal(signal.SIGINT, lambda n, _f: interrupted.append(n))
            try:
                self._start(ctx, args, config, frontends, sock, count, serve)
            finally:
                if main:
                    signal.signal(signal.SIGINT, handler)
                signal.pthread_sigmask(signal.SIG_SETMASK, previous)  # a held Ctrl-C raises here
            if interrupted:
                signal.raise_signal(signal.SIGINT)
        except BaseException:
            self.stop(5)  # they would wait for their lifelines, and this process's exit for them
            raise
        threading.Thread(target=self._watch, name="fastdeploy-api-servers", daemon=True).start()

    def _start(self, ctx, args, config, frontends, sock, count, serve) -> None:
        for index, (cmd_conn, out_conn) in enumerate(frontends, start=1):
            lifeline_recv, lifeline_send = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=run_api_worker,
                args=(index, count, args, config, cmd_conn, out_conn, sock, lifeline_recv, serve),
                name=f"fastdeploy-api-server-{index}",
            )
            proc.start()
            lifeline_recv.close()
            self.procs.append(proc)
            self._lifelines.append(lifeline_send)

    def _watch(self) -> None:
        """Log an API server process that exits while the server is not stopping."""
        pending = {p.sentinel: (i, p) for i, p in enumerate(self.procs, start=1)}
        while pending:
            for sentinel in wait(list(pending)):
                index, proc = pending.pop(sentinel)
                proc.join(1)
                if not self._stopping:
                    logger.error(
                        "API server %d (pid %d) exited with code %s; the engine aborted its "
                        "requests, %d API server process(es) serve on",
                        index,
                        proc.pid,
                        proc.exitcode,
                        1 + sum(p.is_alive() for p in self.procs),
                    )

    def signal_stop(self) -> None:
        """Start their graceful shutdowns (SIGTERM); idempotent."""
        if self._stopping:
            return
        self._stopping = True
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()

    def stop(self, timeout_s: float) -> bool:
        """:meth:`signal_stop`, then wait up to ``timeout_s`` in all for them to exit; the ones
        still running are killed. Blocking. Returns True when all exited by themselves."""
        self.signal_stop()
        deadline = time.monotonic() + timeout_s
        clean = True
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                clean = False
                logger.error("API server process %d did not stop in time; killing it", proc.pid)
                proc.kill()
                proc.join(10)
        for lifeline in self._lifelines:
            lifeline.close()
        return clean


def run_api_worker(
    index: int,
    count: int,
    args: argparse.Namespace,
    config: FDConfig,
    cmd_conn: Any,
    out_conn: Any,
    sock: socket.socket,
    lifeline: Any,
    serve: Callable[..., None],
) -> None:
    """Main function of API server process ``index`` (1..count-1): attach to the engine
    process, serve ``sock`` with ``serve`` (the HTTP layer) until SIGTERM or the first
    process's end."""
    from fastdeploy.entrypoints.engine_client.process_client import (
        EngineCoreClient,
        EngineStartError,
    )

    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s %(levelname)s %(name)s[{index}]: %(message)s",
    )
    # SIGINT stays blocked (the mask this process started with: APIServerWorkers); SIGTERM,
    # outside uvicorn's own handler (before it runs, and when it re-raises the signal that
    # stopped it), ends the process with status 0.
    signal.signal(signal.SIGTERM, _exit_0)
    threading.Thread(
        target=_watch_lifeline, args=(lifeline,), name="fastdeploy-lifeline", daemon=True
    ).start()
    try:
        core = EngineCoreClient(config, cmd_conn, out_conn)
    except EngineStartError as e:
        logger.error("API server %d could not attach to the engine: %s", index, e)
        raise SystemExit(1) from None
    # Without the engine (it ended, or cut this process off as hung) this process leaves, so
    # the others take its connections; the first one answers 503 if the engine is gone.
    core.on_engine_lost = lambda: os.kill(os.getpid(), signal.SIGTERM)
    serve(args, core, index=index, count=count, sock=sock)


def _exit_0(_signum: int, _frame: Any) -> None:
    raise SystemExit(0)


def _watch_lifeline(lifeline: Any) -> None:
    """The first API server process is gone when its end of the lifeline closes: stop this one
    the way it would have (SIGTERM, a graceful shutdown)."""
    try:
        lifeline.recv()
    except (EOFError, OSError):
        pass
    os.kill(os.getpid(), signal.SIGTERM)
