"""Whether the engine loop is stuck: a step that has not ended for longer than a threshold while
there is work (``--engine-stall-timeout``), which ``/health`` reports as 503.

An engine that is alive but makes no progress (a hung device call, a deadlock, a process stopped
by SIGSTOP or swapped out) looks healthy to a liveness check of its process or thread, so a load
balancer keeps sending it traffic that only queues. The loop emits one message per step (and a
``stats`` message after commands that no step follows), so the time since the last message is the
time the current step has run. It only counts while there is work: requests in flight in this API
server process, or running or waiting in the engine by its last counters (with
``--api-server-count`` the other processes' requests show there). An idle engine sends nothing and
is healthy. The clock starts when work arrives at an idle engine, not at its last message; a new
request for an engine that is already busy does not restart it.

The default, :data:`DEFAULT_ENGINE_STALL_TIMEOUT_S` (60 s, the default of vLLM's
``VLLM_ENGINE_ITERATION_TIMEOUT_S``), is far above the slowest step of the default settings:
model loading, KV cache sizing, CUDA graph capture and the first flashinfer JIT all happen before
the server reports ready, and a step is bounded by ``--max-num-batched-tokens`` (2048 by default;
a chunk of 2047 prompt tokens of the default model took 4.3 s on 2 idle CPU cores). A larger
chunk on a CPU needs a larger threshold: 8,189 tokens in one step took 45 s on those 2 idle cores
and 191 s while other processes loaded them (attention grows with the square of the chunk). On a
GPU steps take milliseconds. SGLang's ``--watchdog-timeout`` (300 s) ends the server instead;
this check only reports, and clears itself when steps resume.
"""

from __future__ import annotations

import time
from collections.abc import Callable

#: Seconds without a finished step, while there is work, after which the engine counts as stalled.
DEFAULT_ENGINE_STALL_TIMEOUT_S = 60.0


def check_stall_timeout(value: float | None) -> float | None:
    """``value`` as the stall threshold in seconds: None or 0 turn the check off (None returned).

    Raises:
        ValueError: not a number >= 0, naming the value and the flag.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(
            f"--engine-stall-timeout={value!r} is invalid; allowed: seconds > 0, or 0 to turn "
            "the check off"
        )
    return float(value) or None


class StallWatch:
    """When the engine last made progress, and whether it has work; all on one thread (the
    server's asyncio thread).

    Args:
        timeout_s: the threshold in seconds (None or 0: never stalled; see
            :func:`check_stall_timeout`).
        clock: seconds, monotonic (``time.monotonic``; tests pass a manual clock).

    Raises:
        ValueError: a bad ``timeout_s``.
    """

    def __init__(
        self, timeout_s: float | None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.timeout_s = check_stall_timeout(timeout_s)
        self._clock = clock
        self._last_progress = clock()
        self._engine_busy = False

    def progress(self, engine_busy: bool) -> None:
        """A message of the loop arrived (a step ended, or counters after a command);
        ``engine_busy``: its counters show requests running or waiting."""
        self._last_progress = self._clock()
        self._engine_busy = engine_busy

    def work_added(self, num_in_flight: int) -> None:
        """This process queues a request while ``num_in_flight`` of its own are in flight: when
        nothing was (and the engine showed no work), the clock starts now."""
        if num_in_flight == 0 and not self._engine_busy:
            self._last_progress = self._clock()

    def stalled_for(self, num_in_flight: int) -> float | None:
        """Seconds since the last progress when that exceeds the threshold while there is work
        (``num_in_flight`` requests of this process, or the engine's own); else None."""
        if self.timeout_s is None or not (num_in_flight or self._engine_busy):
            return None
        waited = self._clock() - self._last_progress
        return waited if waited > self.timeout_s else None

    def reason(self, num_in_flight: int) -> str | None:
        """Why the engine counts as stalled (for ``/health``'s body and the log), or None."""
        waited = self.stalled_for(num_in_flight)
        if waited is None:
            return None
        return (
            f"the engine has not finished a step for {waited:.1f} s while it has work "
            f"({num_in_flight} request(s) in flight here; --engine-stall-timeout="
            f"{self.timeout_s:g})"
        )
