"""The engine process's command source: the API servers' command pipes, read on the loop's thread.

:class:`~fastdeploy.engine.engine_loop.EngineLoop` drains its commands between steps. In the
engine process they arrive on pipes, one per API server process. A thread that receives from a
pipe and queues what it gets would need the GIL for every command, and the loop's thread, which
runs Python for most of a step (the step is host-bound on a small model), hands the GIL over
only when it blocks or when the interpreter's switch interval (5 ms by default) has run out: on a
2-core host, a command queued by such a thread reached a loop of 1.3 ms steps 5.8 ms (p50) after
it was sent, and 0.7 ms when the loop polled the pipe itself. So :class:`PipeCommands` polls the
pipes when the loop drains (one ``poll`` system call per pipe and drain) and blocks on them,
with ``multiprocessing.connection.wait``, only when the loop is idle.

Commands from threads of this process (an engine's wake-up, a pipe that closed, a front end the
router cut off) go into a queue that :meth:`PipeCommands.put` fills; it wakes an idle loop
through a pipe of its own.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable, Sequence
from multiprocessing.connection import wait
from typing import Any

from fastdeploy.engine.engine_loop import StopLoop

logger = logging.getLogger(__name__)

#: Seconds between the checks of :meth:`PipeCommands.watch_until_ready` for a closed pipe.
WATCH_POLL_S = 0.05


class PipeCommands:
    """The loop's commands (``get(timeout=)``, ``get_nowait()``, ``put()``, as on a
    ``queue.SimpleQueue``): the front ends' pipes, read on the caller's thread, and commands
    put by threads of this process.

    Args:
        conns: each front end's command pipe (``multiprocessing`` connections, read end). Their
            commands go to this object's own queue unless :meth:`set_routes` says otherwise. A
            pipe that reaches end-of-file (its front end died or closed it) is routed a
            :class:`StopLoop` and not read again.

    Only one thread may call :meth:`get` and :meth:`get_nowait` (the loop's); :meth:`put` is
    safe from any thread.

    Raises:
        ValueError: no pipe.
    """

    def __init__(self, conns: Sequence[Any]) -> None:
        if not conns:
            raise ValueError("PipeCommands needs at least one pipe, got none")
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._open: dict[Any, Callable[[Any], None]] = {conn: self._queue.put for conn in conns}
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)

    def set_routes(self, routes: Sequence[Callable[[Any], None]]) -> None:
        """Send each pipe's commands to its route (``route(cmd)``, in the order of the pipes;
        a router's inbox of that front end) instead of this object's queue. Call it before
        any command is read.

        Raises:
            ValueError: not one route per pipe.
        """
        if len(routes) != len(self._open):
            raise ValueError(f"{len(routes)} route(s) for {len(self._open)} pipe(s); need one each")
        self._open = dict(zip(self._open, routes))

    # ------------------------------------------------------------------ any thread
    def put(self, cmd: Any) -> None:
        """Queue ``cmd`` and wake a loop blocked in :meth:`get`."""
        self._queue.put(cmd)
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:  # the wake pipe is full: a wake-up is pending already
            pass
        except OSError:  # closed: nobody waits any more
            pass

    # ------------------------------------------------------------------ loop thread
    def get_nowait(self) -> Any:
        """The next command, reading what the pipes hold first.

        Raises:
            queue.Empty: none.
        """
        for conn in list(self._open):
            self._read(conn)
        return self._queue.get_nowait()

    def get(self, timeout: float | None = None) -> Any:
        """The next command, waiting up to ``timeout`` seconds (None: forever) for one.

        Raises:
            queue.Empty: none came in time.
        """
        try:
            return self.get_nowait()
        except queue.Empty:
            pass
        ready = wait([*self._open, self._wake_r], timeout)
        if self._wake_r in ready:
            os.read(self._wake_r, 4096)
        return self.get_nowait()

    def _read(self, conn: Any) -> None:
        """Route every command ``conn`` holds now; at end-of-file, route ``StopLoop`` and stop
        reading it."""
        route = self._open[conn]
        try:
            while conn.poll():
                route(conn.recv())
        except (EOFError, OSError):
            del self._open[conn]
            route(StopLoop())

    def watch_until_ready(self, ready: threading.Event) -> threading.Thread:
        """Start a thread that, until ``ready`` is set, ends the process (``os._exit(1)``) when
        a pipe closes: the server is gone before the engine was ready, so no request can be in
        flight, and loading a large model to completion would hold its GPU memory for nothing
        (its tensor-parallel ranks exit with it). A command that arrives meanwhile is routed as
        usual. Join the thread (it returns within :data:`WATCH_POLL_S` of ``ready``) before the
        loop reads the pipes."""

        def watch() -> None:
            while not ready.is_set():
                for conn in wait(list(self._open), WATCH_POLL_S):
                    try:
                        cmd = conn.recv()
                    except (EOFError, OSError):
                        logger.error(
                            "the server process is gone before the engine was ready; exiting"
                        )
                        os._exit(1)
                        return  # reached only where a test replaced os._exit
                    self._open[conn](cmd)

        thread = threading.Thread(target=watch, name="fastdeploy-engine-watch", daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        """Close the wake pipe (the front ends' pipes belong to the caller)."""
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
