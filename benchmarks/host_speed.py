"""The host's single-thread Python speed, recorded next to a benchmark run's numbers.

Rows of the step-speed table that are bound by host work (a SmolLM2-135M decode step, its
piecewise prefill, the served rows) move with the speed of the host's CPU, and the GPU hosts
lent for a run differ: the loop below took 65 to 141 ms on the H200 hosts of the project's
runs, and on one host it went from 130 to 67 ms within minutes. ``run_step_speed.sh`` runs this
before each part, so that the report can say how fast the host was while each part ran::

    python benchmarks/host_speed.py --json /tmp/step_speed/host_peers.json

It times a fixed pure-Python loop (1,000,000 integer additions at module level, as
``python3 -c`` runs it, where every name is a global: the form the project's notes quote; the
same loop inside a function, on local names, runs about twice as fast), best and median of
``--repeats`` runs, in milliseconds, and records the CPU model, the core count and the Python
version (the loop's time depends on it too).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

#: Iterations of the timed loop.
LOOP = 1_000_000


#: The timed loop, run at module level (global names) by :func:`loop_ms`.
LOOP_SOURCE = f"s = 0\nfor i in range({LOOP}):\n    s += i\n"
_LOOP_CODE = compile(LOOP_SOURCE, "<host_speed loop>", "exec")


def loop_ms() -> float:
    """Milliseconds of one run of :data:`LOOP_SOURCE` in a fresh global namespace."""
    namespace: dict = {}
    t0 = time.perf_counter()
    exec(_LOOP_CODE, namespace)
    return 1e3 * (time.perf_counter() - t0)


def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (Linux), else what ``platform`` says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def measure(repeats: int) -> dict:
    """``{"loop_ms_best", "loop_ms_median", "repeats", "cpu", "cpu_count", "python"}``.

    Raises:
        ValueError: ``repeats`` below 1.
    """
    if repeats < 1:
        raise ValueError(f"repeats={repeats} is invalid; allowed: 1 or more")
    times = [loop_ms() for _ in range(repeats)]
    return {
        "loop_ms_best": min(times),
        "loop_ms_median": statistics.median(times),
        "repeats": repeats,
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs of the loop (default 5)")
    parser.add_argument("--json", default=None, help="also write the result to this file")
    args = parser.parse_args(argv)
    try:
        result = measure(args.repeats)
    except ValueError as e:
        parser.error(str(e))
    print(
        f"host: {result['cpu']} ({result['cpu_count']} cores), Python {result['python']}; "
        f"{LOOP:,}-iteration loop best {result['loop_ms_best']:.0f} ms, median "
        f"{result['loop_ms_median']:.0f} ms"
    )
    if args.json:
        try:
            Path(args.json).write_text(json.dumps(result, indent=1))
        except OSError as e:
            parser.error(f"--json {args.json!r} could not be written: {e}")
    return result


if __name__ == "__main__":
    main()
