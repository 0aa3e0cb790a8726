"""Start the worker ranks of one node as processes and watch them.

Rank 0 runs in the engine's own process (it owns the scheduler); ranks ``1..n-1`` of this node are
started here with the ``spawn`` method (CUDA cannot be used after ``fork``). A rank that exits
while the engine runs is an error that names the rank and its exit code, raised at the next check,
so the engine ends instead of hanging in a collective. :meth:`RankProcesses.stop` ends every rank
(SIGTERM, then SIGKILL after a grace period), and it runs even when the engine fails.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import wait

logger = logging.getLogger(__name__)


class RankDiedError(RuntimeError):
    """A worker rank exited while the engine was running."""

    def __init__(self, rank: int, exitcode: int | None) -> None:
        how = (
            f"was killed by signal {-exitcode}"
            if exitcode and exitcode < 0
            else (f"exited with code {exitcode}")
        )
        super().__init__(f"tensor-parallel rank {rank} {how}; the engine cannot continue")
        self.rank = rank
        self.exitcode = exitcode


class RankProcesses:
    """The worker ranks of this node.

    Args:
        target: ``target(rank, *args)``, run in each new process (module-level, picklable).
        ranks: the global ranks to start here (rank 0 is the caller's own process).
        args: extra arguments for ``target``.
    """

    def __init__(self, target: Callable, ranks: list[int], args: tuple = ()) -> None:
        ctx = mp.get_context("spawn")
        self.processes = {
            rank: ctx.Process(
                target=target, args=(rank, *args), name=f"fastdeploy-rank-{rank}", daemon=True
            )
            for rank in ranks
        }

    def start(self) -> RankProcesses:
        for p in self.processes.values():
            p.start()
        return self

    def check(self, timeout_s: float = 0.0) -> None:
        """Raise if a rank has exited; waits up to ``timeout_s`` for one to exit.

        Raises:
            RankDiedError: naming the first rank found dead.
        """
        sentinels = {p.sentinel: rank for rank, p in self.processes.items()}
        for sentinel in wait(list(sentinels), timeout=timeout_s):
            rank = sentinels[sentinel]
            process = self.processes[rank]
            process.join(1)
            raise RankDiedError(rank, process.exitcode)

    @property
    def pids(self) -> dict[int, int | None]:
        """rank -> process id (None before :meth:`start`)."""
        return {rank: p.pid for rank, p in self.processes.items()}

    def stop(self, grace_s: float = 5.0, exit_wait_s: float = 0.0) -> None:
        """End every rank: wait up to ``exit_wait_s`` for them to exit on their own (after a
        shutdown message), then SIGTERM, then SIGKILL for those still alive after ``grace_s``."""
        deadline = time.monotonic() + exit_wait_s
        for p in self.processes.values():
            if p.pid is not None:
                p.join(max(deadline - time.monotonic(), 0))
        started = [p for p in self.processes.values() if p.pid is not None]
        for p in started:
            if p.is_alive():
                p.terminate()
        for p in started:
            p.join(grace_s)
            if p.is_alive():
                logger.warning("rank process %s ignored SIGTERM; killing it", p.name)
                p.kill()
                p.join(grace_s)

    def __enter__(self) -> RankProcesses:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def exit_on_sigterm() -> None:
    """In a rank process: turn SIGTERM into ``SystemExit`` so ``finally`` blocks run."""

    def handler(signum, frame):  # noqa: ARG001
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def exit_with_parent(poll_s: float = 0.5) -> None:
    """In a rank process: exit (code 1) as soon as the process that started it is gone, even
    when that one was killed without a chance to stop its ranks. A daemon thread polls
    ``os.getppid()``; ``os._exit`` ends the process even while its main thread is blocked in a
    collective."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:
                logger.error("the engine process %d is gone; rank process exits", parent)
                os._exit(1)

    threading.Thread(target=watch, name="fastdeploy-parent-watch", daemon=True).start()
