"""Soak: hold a server under streaming load for a long time and watch for errors and leaks.

Waves of concurrent streams (``load_client.py``: every other client leaves after its first
token; every ``--burst-every``-th wave is a burst above ``--max-concurrency``, so 429s happen)
run back to back for ``--duration`` seconds after a warm-up. Every ``--report-every`` seconds one
row is printed: elapsed time, requests ok / aborted / 429 / errors so far, the RSS of the server
and engine processes, KV blocks used / free, and ``/health``'s status. At the end, once the
server is idle, the RSS of each process is compared with its level after the warm-up (what the
allocators keep from first use is not counted).

Exit status 1 (with the reasons) on any error outcome, RSS growth over ``--rss-growth``, KV
blocks not all free at the end, or ``/health`` not 200; else 0. One command (starts
``fastdeploy serve`` with the default model on a free port, 10 minutes)::

    python benchmarks/benchmark_soak.py
    python benchmarks/benchmark_soak.py --url http://127.0.0.1:8000 --duration 3600

RSS is read from ``/proc/<pid>/status`` (``VmRSS``), the pids from ``/v1/server_info``
(``api_server.pid``, ``engine_pid``): against a server on another host it shows ``n/a`` and is
not judged.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # load_client, when run as a script

from load_client import LoadResult, raise_open_files_limit, run_wave  # noqa: E402

DEFAULT_SERVE_ARGS = "--max-model-len 512 --log-level warning"
COLUMNS = ("elapsed_s", "ok", "aborted", "429", "errors", "server_MiB", "engine_MiB",
           "kv_used", "kv_free", "health")  # fmt: skip


def rss_mib(pid: int | None) -> float | None:
    """Resident set size of ``pid`` in MiB, or None where ``/proc`` cannot tell."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (OSError, TypeError):
        pass
    return None


class Probe:
    """What one row reads from the server: ``/health``, ``/v1/server_info`` and the RSS."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.client = httpx.AsyncClient(base_url=url, timeout=30)
        self.pids: dict[str, int | None] = {"server": None, "engine": None}

    async def sample(self) -> dict:
        """``{health, kv_used, kv_free, in_flight, server_MiB, engine_MiB}`` (None where the
        server did not answer)."""
        out: dict = {"health": None, "kv_used": None, "kv_free": None, "in_flight": None}
        try:
            out["health"] = (await self.client.get("/health")).status_code
            info = (await self.client.get("/v1/server_info")).json()
            stats = info.get("stats") or {}
            self.pids = {"server": info["api_server"]["pid"], "engine": info.get("engine_pid")}
            out["kv_free"] = stats.get("num_free_blocks")
            total = stats.get("num_total_blocks")
            out["kv_used"] = None if total is None else total - out["kv_free"]
            out["in_flight"] = info.get("num_in_flight")
            out["model"] = info.get("model")
        except (httpx.HTTPError, ValueError, KeyError) as e:
            out["error"] = f"{type(e).__name__}: {e}"
        for name, pid in self.pids.items():
            out[f"{name}_MiB"] = rss_mib(pid)
        return out

    async def wait_idle(self, timeout_s: float) -> dict:
        """Sample until nothing is in flight and every block is free (or ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while True:
            s = await self.sample()
            if (s["in_flight"] == 0 and s["kv_used"] == 0) or time.monotonic() > deadline:
                return s
            await asyncio.sleep(0.5)


def row(elapsed: float, result: LoadResult, s: dict) -> str:
    """One line of the table."""
    c = result.counts
    values = (
        f"{elapsed:.0f}", c["ok"], c["aborted"], c["429"], c["error"], s.get("server_MiB"),
        s.get("engine_MiB"), s["kv_used"], s["kv_free"], s["health"],
    )  # fmt: skip
    return "  ".join(f"{row_value(v):>10}" for v in values)


def row_value(v) -> str:
    """A table cell: ``n/a`` for None, floats without decimals."""
    return "n/a" if v is None else f"{v:.0f}" if isinstance(v, float) else str(v)


def verdict(baseline: dict, end: dict, result: LoadResult, rss_growth: float) -> list[str]:
    """The reasons the soak failed (empty: it passed): errors, RSS growth over ``rss_growth``
    (a fraction) in a process, blocks not all free, ``/health`` not 200."""
    problems = []
    if result.counts["error"]:
        problems.append(f"{result.counts['error']} request(s) ended in error: {result.errors[:3]}")
    for name in ("server", "engine"):
        key = f"{name}_MiB"
        before, after = baseline.get(key), end.get(key)
        if before and after and after > before * (1 + rss_growth):
            problems.append(
                f"{name} RSS grew {after / before - 1:+.1%} ({before:.0f} -> {after:.0f} MiB), "
                f"over --rss-growth={rss_growth:g}"
            )
    if end.get("kv_used") != 0:
        problems.append(f"KV blocks not all free at the end: {end.get('kv_used')} used")
    if end.get("health") != 200:
        problems.append(f"/health answered {end.get('health')} at the end")
    return problems


async def soak(url: str, args: argparse.Namespace) -> int:
    """Warm up, run waves for ``args.duration`` s with a row every ``args.report_every`` s,
    judge; returns the exit status."""
    probe = Probe(url)
    result = LoadResult()
    index = 0

    async def wave(n: int) -> None:
        nonlocal index
        await run_wave(url, n, args.max_tokens, args.leave_every, first_index=index, result=result)
        index += n

    print(f"# warm-up: a burst of {args.burst} streams, then {args.streams}", flush=True)
    await wave(args.burst)
    await wave(args.streams)
    baseline = await probe.wait_idle(60)
    print(f"# model {baseline.get('model')}; after the warm-up: server "
          f"{row_value(baseline.get('server_MiB'))} MiB, engine "
          f"{row_value(baseline.get('engine_MiB'))} MiB, KV used/free "
          f"{baseline['kv_used']}/{baseline['kv_free']}")  # fmt: skip
    result.counts.clear()
    print("  ".join(f"{c:>10}" for c in COLUMNS), flush=True)
    start = time.monotonic()

    async def report() -> None:
        while True:
            await asyncio.sleep(args.report_every)
            print(row(time.monotonic() - start, result, await probe.sample()), flush=True)

    reporter = asyncio.create_task(report())
    waves = 0
    try:
        while time.monotonic() - start < args.duration:
            waves += 1
            burst = args.burst_every and waves % args.burst_every == 0
            await wave(args.burst if burst else args.streams)
    finally:
        reporter.cancel()
    end = await probe.wait_idle(60)
    print(row(time.monotonic() - start, result, end) + "   (end, idle)")
    await probe.client.aclose()
    problems = verdict(baseline, end, result, args.rss_growth)
    for name in ("server", "engine"):
        b, e = baseline.get(f"{name}_MiB"), end.get(f"{name}_MiB")
        if b and e:
            print(f"# {name} RSS: {b:.0f} -> {e:.0f} MiB ({e / b - 1:+.1%})")
    print(f"# {waves} waves, {sum(result.counts.values())} requests in "
          f"{time.monotonic() - start:.0f} s")  # fmt: skip
    for p in problems:
        print(f"FAIL: {p}")
    print("PASS" if not problems else f"FAIL ({len(problems)} problem(s))", flush=True)
    return 1 if problems else 0


def start_server(serve_args: str) -> tuple[subprocess.Popen, str]:
    """``fastdeploy serve`` on a free port of 127.0.0.1 in a session of its own (its output
    goes to this process's stderr); returns it and its URL once ``/health`` answers 200.

    Raises:
        RuntimeError: it exited, or did not answer within 10 minutes.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "fastdeploy.entrypoints.cli.main", "serve", "--host",
           "127.0.0.1", "--port", str(port), *shlex.split(serve_args)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=sys.stderr, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}: {shlex.join(cmd)}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    stop_server(proc)
    raise RuntimeError(f"the server did not answer /health within 600 s: {shlex.join(cmd)}")


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group (a graceful stop), SIGKILL after 60 s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    except ProcessLookupError:
        pass


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, start the server unless ``--url``, soak; returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running server (default: start fastdeploy serve here)")
    p.add_argument(
        "--serve-args",
        default=DEFAULT_SERVE_ARGS,
        help=f"arguments of the server it starts (default: {DEFAULT_SERVE_ARGS!r})",
    )
    p.add_argument("--duration", type=float, default=600, help="seconds (default: 600)")
    p.add_argument("--report-every", type=float, default=30, help="seconds per row (default: 30)")
    p.add_argument("--streams", type=int, default=128, help="streams per wave (default: 128)")
    p.add_argument(
        "--burst",
        type=int,
        default=600,
        help="streams of a burst wave, above --max-concurrency (default: 600)",
    )
    p.add_argument(
        "--burst-every",
        type=int,
        default=5,
        help="every N-th wave is a burst; 0: none (default: 5)",
    )
    p.add_argument("--max-tokens", type=int, default=8, help="tokens per stream (default: 8)")
    p.add_argument(
        "--leave-every",
        type=int,
        default=2,
        help="every N-th client leaves after its first token; 0: none (default: 2)",
    )
    p.add_argument(
        "--rss-growth",
        type=float,
        default=0.10,
        help="largest RSS growth allowed per process, a fraction (default: 0.10)",
    )
    args = p.parse_args(argv)  # fmt: skip
    for name in ("duration", "report_every", "streams", "burst", "max_tokens"):
        if not getattr(args, name) > 0:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)} is invalid; allowed: > 0")
    raise_open_files_limit(max(args.streams, args.burst) + 256)
    print(f"# soak: host {platform.node()} ({os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f}), {args.duration:.0f} s, waves of {args.streams} streams "
          f"(a burst of {args.burst} every {args.burst_every}), {args.max_tokens} tokens each, "
          f"1 client in {args.leave_every} leaves after its first token", flush=True)  # fmt: skip
    proc = None
    url = args.url
    if url is None:
        print(f"# starting fastdeploy serve {args.serve_args}", flush=True)
        proc, url = start_server(args.serve_args)
    try:
        return asyncio.run(soak(url.rstrip("/"), args))
    finally:
        if proc is not None:
            stop_server(proc)


if __name__ == "__main__":
    sys.exit(main())
