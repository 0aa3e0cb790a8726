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
import signal
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

    def stop(self, grace_s: float = 5.0) -> None:
        """End every rank: SIGTERM, then SIGKILL for those still alive after ``grace_s``."""
        for p in self.processes.values():
            if p.is_alive():
                p.terminate()
        for p in self.processes.values():
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
