"""A harness for end-to-end PD tests: real server and router processes on 127.0.0.1 that are
always cleaned up, even when a test fails.

Every process starts in its own session (``start_new_session=True``), so its process group holds
it and everything it spawns; :meth:`Cluster.close` sends the group SIGTERM, then SIGKILL after a
grace period, and checks that no process of the group is left. Output goes to a log file per
process (a pipe nobody reads would block a chatty server); failures quote its tail.

Usage (processes start in parallel; waits are bounded)::

    with Cluster() as cluster:
        a = cluster.start_server([])
        b = cluster.start_server(["--splitwise-role", "prefill"])
        cluster.wait_healthy(a, b)
        router = cluster.start_router(["--backend", a.url, b.url])
        cluster.wait_healthy(router)

As a pytest fixture: ``with Cluster(tmp_path) as cluster: yield cluster``.

The servers run the bundled default model (SmolLM2-135M, GGUF) with :data:`SMALL_SERVER_ARGS`,
so that one starts in about 11 s on a 2-core CPU machine.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
from splitwise_utils import free_port

__all__ = [
    "Cluster",
    "Proc",
    "free_port",
    "group_pids",
    "kill_group",
    "kill_groups",
    "start_router",
    "start_server",
    "wait_healthy",
]

SERVER_CMD = [sys.executable, "-m", "fastdeploy.entrypoints.openai.api_server"]
ROUTER_CMD = [sys.executable, "-m", "fastdeploy.router"]
#: Settings that make a CPU server start fast: a short context, a fixed small KV pool (no memory
#: profiling), few sequences, and a short graceful shutdown.
SMALL_SERVER_ARGS = [
    "--max-model-len", "2048",
    "--num-gpu-blocks-override", "128",
    "--max-num-seqs", "8",
    "--timeout-graceful-shutdown", "1",
    "--log-level", "warning",
]  # fmt: skip
#: Seconds a server may take to become healthy (about 11 s alone, more with others starting).
STARTUP_TIMEOUT_S = 180.0
#: Seconds between SIGTERM and SIGKILL of a process group.
GRACE_S = 5.0

#: Process groups started and not yet killed; killed at interpreter exit as a backstop.
_LIVE_GROUPS: set[int] = set()


@dataclass
class Proc:
    """A started process: its ``Popen`` (the leader of its own process group), name, URL, log."""

    name: str
    popen: subprocess.Popen
    url: str
    log_path: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def log_tail(self, chars: int = 4000) -> str:
        """The last ``chars`` characters of its output (stdout and stderr)."""
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return ""

    def check_alive(self) -> None:
        """Raise ``AssertionError`` with the output tail when the process has exited."""
        code = self.popen.poll()
        if code is not None:
            raise AssertionError(
                f"{self.name} (pid {self.pid}) exited with status {code}; its output ends:\n"
                f"{self.log_tail()}"
            )


def start_process(
    name: str, argv: Sequence[str], url: str, log_dir: Path, env: dict[str, str] | None = None
) -> Proc:
    """Start ``argv`` in a new session, output to ``log_dir/<name>.log``."""
    log_path = Path(log_dir) / f"{name}.log"
    with open(log_path, "wb") as log:
        popen = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )
    _LIVE_GROUPS.add(popen.pid)
    return Proc(name, popen, url, log_path)


def start_server(
    args: Sequence[str], port: int | None = None, log_dir: Path | None = None, name: str = ""
) -> Proc:
    """``python -m fastdeploy.entrypoints.openai.api_server --host 127.0.0.1 --port P --device cpu``
    with :data:`SMALL_SERVER_ARGS` and then ``args`` (later flags win)."""
    port = port or free_port()
    argv = [*SERVER_CMD, "--host", "127.0.0.1", "--port", str(port), "--device", "cpu"]
    argv += [*SMALL_SERVER_ARGS, *args]
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="pd_cluster_"))
    return start_process(name or f"server-{port}", argv, f"http://127.0.0.1:{port}", log_dir)


def start_router(
    args: Sequence[str], port: int | None = None, log_dir: Path | None = None, name: str = ""
) -> Proc:
    """``python -m fastdeploy.router --host 127.0.0.1 --port P`` and ``args`` (``--backend URL
    ...`` or ``--prefill URL --decode URL``); health polls every 0.2 s so it is ready soon."""
    port = port or free_port()
    argv = [*ROUTER_CMD, "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--health-interval-s", "0.2", "--log-level", "warning", *args]
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="pd_cluster_"))
    return start_process(name or f"router-{port}", argv, f"http://127.0.0.1:{port}", log_dir)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def wait_healthy(url: str, proc: Proc, timeout: float = STARTUP_TIMEOUT_S) -> None:
    """Wait until ``url/health`` answers 200.

    Raises:
        AssertionError: at once when ``proc`` exits (quoting its output tail), or after
            ``timeout`` seconds (likewise).
    """
    deadline = time.monotonic() + timeout
    while True:
        proc.check_alive()
        if _healthy(url):
            return
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{proc.name} not healthy at {url}/health after {timeout} s; its output ends:\n"
                f"{proc.log_tail()}"
            )
        time.sleep(0.1)


def group_pids(pgid: int) -> list[int]:
    """Live (non-zombie) processes in process group ``pgid``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Fields after the ")" that closes the command name: state, ppid, pgrp, ...
        state, _ppid, pgrp = stat.rsplit(")", 1)[1].split()[:3]
        if int(pgrp) == pgid and state != "Z":
            pids.append(int(entry.name))
    return pids


def kill_group(proc: Proc, grace_s: float = GRACE_S) -> None:
    """:func:`kill_groups` of one process."""
    kill_groups([proc], grace_s)


def kill_groups(procs: Sequence[Proc], grace_s: float = GRACE_S) -> None:
    """SIGTERM the process groups of ``procs`` at once, SIGKILL them after at most ``grace_s``
    seconds, reap the leaders.

    Raises:
        AssertionError: a process of a group is still alive 10 s after SIGKILL.
    """
    for proc in procs:
        with _suppress_gone():
            os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.popen.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for proc in procs:
        with _suppress_gone():  # children that outlived their leader, or a leader ignoring TERM
            os.killpg(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    for proc in procs:
        proc.popen.wait(10)
        while group_pids(proc.pid):
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{proc.name}: still alive after SIGKILL: {group_pids(proc.pid)}"
                )
            time.sleep(0.05)
        _LIVE_GROUPS.discard(proc.pid)


@contextmanager
def _suppress_gone() -> Iterator[None]:
    try:
        yield
    except ProcessLookupError:
        pass


@atexit.register
def _kill_leftovers() -> None:
    """Backstop for an interpreter that exits without unwinding (the test runner killed)."""
    for pgid in list(_LIVE_GROUPS):
        with _suppress_gone():
            os.killpg(pgid, signal.SIGKILL)


class Cluster:
    """Processes started together and killed together (a context manager).

    Args:
        log_dir: where the per-process logs go (default: a new temporary directory).
        grace_s: seconds between SIGTERM and SIGKILL at :meth:`close`.
    """

    def __init__(self, log_dir: Path | None = None, grace_s: float = GRACE_S) -> None:
        self.log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="pd_cluster_"))
        self.grace_s = grace_s
        self.procs: list[Proc] = []

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start_server(self, args: Sequence[str] = (), port: int | None = None, name: str = ""):
        """:func:`start_server`, owned by this cluster."""
        return self._own(start_server(args, port, self.log_dir, name))

    def start_router(self, args: Sequence[str], port: int | None = None, name: str = ""):
        """:func:`start_router`, owned by this cluster."""
        return self._own(start_router(args, port, self.log_dir, name))

    def start(self, name: str, argv: Sequence[str], url: str, env: dict | None = None) -> Proc:
        """Any other process (e.g. a third-party router), owned by this cluster."""
        return self._own(start_process(name, argv, url, self.log_dir, env))

    def wait_healthy(self, *procs: Proc, timeout: float = STARTUP_TIMEOUT_S) -> None:
        """Wait for every one of ``procs`` at once (see :func:`wait_healthy`)."""
        deadline = time.monotonic() + timeout
        pending = list(procs)
        while pending:
            for proc in list(pending):
                proc.check_alive()
                if _healthy(proc.url):
                    pending.remove(proc)
            if pending and time.monotonic() > deadline:
                raise AssertionError(
                    f"not healthy after {timeout} s: "
                    + "; ".join(f"{p.name}, output ends:\n{p.log_tail(2000)}" for p in pending)
                )
            time.sleep(0.1)

    def close(self) -> None:
        """Kill every process group, all at once (see :func:`kill_groups`)."""
        procs, self.procs = self.procs, []
        kill_groups(procs, self.grace_s)

    def alive_pids(self) -> list[int]:
        """Live processes of every group this cluster started (empty after :meth:`close`)."""
        return [pid for p in self.procs for pid in group_pids(p.pid)]

    def _own(self, proc: Proc) -> Proc:
        self.procs.append(proc)
        return proc
