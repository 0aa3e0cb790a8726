"""``fastdeploy serve`` and ``fastdeploy router`` as subprocesses for the load and stall tests:
each in a session of its own, logging to a file, killed with every process it started (even
when the test fails), plus what those tests read from them (the engine's pid, RSS, KV blocks).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
from http_server_utils import free_port, get_json, process_group_pids, wait_until

CLI = [sys.executable, "-m", "fastdeploy.entrypoints.cli.main"]
STARTUP_TIMEOUT_S = 300


class Process:
    """A ``fastdeploy`` subcommand (``serve`` or ``router``) on a free port of 127.0.0.1.

    Args:
        tmp_path: where its log (and Prometheus files) go.
        command: ``serve`` or ``router``.
        args: its further arguments (``--host`` and ``--port`` are added).
        count: API server processes that must answer before it counts as up (``serve``).
        env: environment variables to set for it (``FD_CPU_KV_CACHE_SPACE``, ...).
    """

    def __init__(
        self,
        tmp_path: Path,
        command: str,
        args: list[str],
        count: int = 1,
        env: dict[str, str] | None = None,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp_path / f"{command}-{self.port}.log"
        metrics_dir = tmp_path / f"metrics-{self.port}"
        metrics_dir.mkdir()
        # A server killed with SIGKILL cannot remove a metrics directory it made itself.
        env = {**os.environ, **(env or {}), "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)}
        if "--api-server-count" not in args:
            env.pop("PROMETHEUS_MULTIPROC_DIR")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [*CLI, command, "--host", "127.0.0.1", "--port", str(self.port), *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=env,
            )
        self.count = count
        self._seen: set[int] = set()
        try:
            wait_until(self._ready, STARTUP_TIMEOUT_S, f"fastdeploy {command} to start")
        except BaseException:
            self.kill()
            raise

    def log(self, tail: int = 6000) -> str:
        return self.log_path.read_text(errors="replace")[-tail:]

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"exited with {self.proc.returncode}:\n{self.log()}")
        try:
            if self.health()[0] != 200:
                return False
            if self.count > 1:  # fresh connections reach the processes in turn
                info = httpx.get(self.url + "/v1/server_info", timeout=10).json()
                self._seen.add(info["api_server"]["index"])
        except httpx.HTTPError:
            return False
        return len(self._seen) >= self.count or self.count == 1

    def health(self) -> tuple[int, dict]:
        """``/health``'s status and JSON body."""
        r = httpx.get(self.url + "/health", timeout=10)
        return r.status_code, r.json()

    def kill(self) -> None:
        """SIGKILL its process group, then any process of the group still left."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        for pid in process_group_pids(self.proc.pid):
            try:
                os.kill(pid, signal.SIGCONT)  # a stopped process dies only once continued
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def __enter__(self) -> Process:
        return self

    def __exit__(self, *exc) -> None:
        self.kill()


def serve(tmp_path: Path, *args: str, count: int = 1, env: dict[str, str] | None = None) -> Process:
    """``fastdeploy serve`` with the default model and ``args`` (``count`` API server
    processes; ``env``: variables to set)."""
    extra = ["--api-server-count", str(count)] if count > 1 else []
    return Process(tmp_path, "serve", [*args, *extra], count=count, env=env)


def router(tmp_path: Path, *backends: str) -> Process:
    """``fastdeploy router`` in plain mode in front of ``backends``."""
    return Process(tmp_path, "router", ["--backend", *backends, "--log-level", "warning"])


def engine_pid(url: str) -> int:
    """The engine process's pid (``/v1/server_info``)."""
    return get_json(url, "/v1/server_info")["engine_pid"]


def rss_kib(pid: int) -> int:
    """Resident set size of process ``pid`` in KiB (``VmRSS`` of ``/proc/<pid>/status``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")


def kv_blocks(url: str) -> tuple[int, int, int]:
    """``(requests in flight, free KV blocks, total KV blocks)`` from ``/v1/server_info`` (the
    engine's counters as of its last message)."""
    info = get_json(url, "/v1/server_info")
    stats = info["stats"]
    return info["num_in_flight"], stats["num_free_blocks"], stats["num_total_blocks"]


def wait_all_blocks_free(url: str, timeout_s: float = 60) -> tuple[int, int]:
    """Wait until nothing is in flight and every KV block is free; returns (free, total)."""
    state: list = []

    def idle() -> bool:
        state[:] = kv_blocks(url)
        return state[0] == 0 and state[1] == state[2] > 0

    try:
        wait_until(idle, timeout_s, "every KV block free")
    except AssertionError as e:
        raise AssertionError(f"{e}: (in flight, free, total) = {tuple(state)}") from None
    return state[1], state[2]
