"""Functions the TP tests run in spawned rank processes (module level, so they pickle)."""

from __future__ import annotations

import os
import sys
import time


def collective_rank(rank: int, world: int, addr: str, out_dir: str) -> None:
    """Join the group, all-reduce, all-gather and receive rank 0's step; write what it saw."""
    import torch

    from fastdeploy.distributed.parallel_state import (
        all_gather_last_dim,
        all_reduce,
        broadcast_step,
        destroy_tp_group,
        init_tp_group,
    )

    tp = init_tp_group(rank, world, addr, "cpu", timeout_s=60)
    try:
        summed = all_reduce(torch.full((3,), float(rank + 1)), tp).tolist()
        gathered = all_gather_last_dim(torch.full((2, 1), float(rank)), tp)[0].tolist()
        step = broadcast_step({"step": 7, "from": rank} if rank == 0 else None, tp)
        with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
            f.write(repr((summed, gathered, step)))
    finally:
        destroy_tp_group()


def die_rank(rank: int, code: int) -> None:
    """Exit with ``code`` after a moment (a rank that crashes)."""
    time.sleep(0.2)
    sys.exit(code)


def stubborn_rank(rank: int) -> None:
    """Ignore SIGTERM (stop() must kill it)."""
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(600)
