"""Start-up phase timing (issue #47): how long each phase of an engine's start took, printed once
at start and exported (``get_stats()["startup_seconds"]``, ``fastdeploy:startup_phase_seconds``).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator


def process_age_seconds() -> float | None:
    """Seconds since this process started (Linux ``/proc``: the process's start tick against the
    system uptime); None where that cannot be read. At an engine's construction it is what the
    interpreter, the imports and the argument handling took."""
    try:
        with open("/proc/self/stat") as f:
            stat = f.read()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        # Fields after the command name (which may hold spaces) start at field 3; field 22 is
        # the start time in clock ticks since boot.
        start_ticks = int(stat.rsplit(")", 1)[1].split()[19])
        return max(uptime - start_ticks / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError):
        return None


class StartupPhases:
    """Seconds per start-up phase, in the order they ran.

    Args:
        seconds: phases already timed (name -> seconds), e.g. by the caller before the engine.
    """

    def __init__(self, seconds: dict[str, float] | None = None) -> None:
        self.seconds: dict[str, float] = {
            k: round(v, 3) for k, v in (seconds or {}).items() if v is not None
        }

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as phase ``name`` (added to it if it ran before); recorded also when
        the block raises."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)

    def add(self, name: str, seconds: float) -> None:
        """Add ``seconds`` to phase ``name``."""
        self.seconds[name] = round(self.seconds.get(name, 0.0) + seconds, 3)

    def describe(self) -> str:
        """``name 1.23 s, name 0.45 s, ...; total 1.68 s``."""
        parts = ", ".join(f"{k} {v:.2f} s" for k, v in self.seconds.items())
        return f"{parts}; total {sum(self.seconds.values()):.2f} s"
