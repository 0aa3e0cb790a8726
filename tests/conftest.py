"""Session-wide test setup.

A test run stopped with SIGTERM (a CI time limit, ``kill``, ``timeout``) unwinds as Ctrl-C does:
pytest then runs the fixtures' teardown, so the servers and worker processes that tests start in
their own sessions are stopped too (the default SIGTERM action ends pytest at once and leaves them
running).

A test that starts a process (a server, an engine process, TP ranks, PD nodes, vllm-router: any
``subprocess.Popen`` or ``multiprocessing`` start, in the test or in a fixture it uses) must carry
the ``slow`` marker, so that ``pytest -m "not slow"`` is the fast part (docs/testing.md). A test
without it that starts one (a Python interpreter, our console scripts, a peer server; see
:data:`SERVERS`) fails, naming what it started; the start itself raises
:class:`ProcessInFastTestError`, so the fast part never waits on a server.
"""

from __future__ import annotations

import multiprocessing.process
import os
import signal
import subprocess
import sys
import threading

import pytest

# What counts as a process a test starts: a Python interpreter (an engine process, a server, TP
# ranks, a benchmark's client), our console scripts, and the peers tests run beside us. Tools
# that libraries run while importing, describing the host or compiling (`file -b`, `uname`,
# ldconfig, a C compiler, ninja, git) are not; GPU tests (the `gpu` marker) are not checked, since
# their kernels' JIT builds run whatever the host's toolchain runs.
SERVERS = {"fastdeploy", "vllm-router", "etcd", "nats-server", "dynamo"}


def _is_server(program: str) -> bool:
    return program.startswith("python") or program in SERVERS


_current: pytest.Item | None = None
_started: dict[str, list[str]] = {}


class ProcessInFastTestError(RuntimeError):
    """A test without the ``slow`` marker started a process."""


def _check_start(what: str) -> None:
    item = _current
    if item is None or item.get_closest_marker("slow") or item.get_closest_marker("gpu"):
        return
    _started.setdefault(item.nodeid, []).append(what)
    raise ProcessInFastTestError(
        f"{item.nodeid} started a process ({what}) without the slow marker: add "
        f"@pytest.mark.slow (or pytestmark = pytest.mark.slow) to it (docs/testing.md)"
    )


_popen_init = subprocess.Popen.__init__
_process_start = multiprocessing.process.BaseProcess.start


def _guarded_popen_init(self, args, *a, **kw):
    argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
    program = os.path.basename(os.fsdecode(argv[0]).split()[0]) if argv else ""
    if _is_server(program) or os.fsdecode(argv[0]) == sys.executable:
        _check_start(f"subprocess {' '.join(map(os.fsdecode, argv))[:200]}")
    _popen_init(self, args, *a, **kw)


def _guarded_process_start(self):
    _check_start(f"multiprocessing {self.name} (target {getattr(self, '_target', None)!r})")
    _process_start(self)


def pytest_configure(config):
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.default_int_handler)
    subprocess.Popen.__init__ = _guarded_popen_init
    multiprocessing.process.BaseProcess.start = _guarded_process_start


def pytest_unconfigure(config):
    subprocess.Popen.__init__ = _popen_init
    multiprocessing.process.BaseProcess.start = _process_start


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    # Set before the item's fixtures (module- and session-scoped ones too) are set up.
    global _current
    _current = item
    try:
        yield
    finally:
        _current = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    started = _started.get(item.nodeid)
    if started and report.when in ("setup", "call") and not report.failed:
        report.outcome = "failed"
        report.longrepr = (
            f"started a process without the slow marker: {started[0]} (add pytest.mark.slow)"
        )
