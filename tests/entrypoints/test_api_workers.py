"""The pieces of ``--api-server-count`` that need no server: the share of ``--max-concurrency``,
the 429 text that names it, and the metrics directory an earlier run left files in."""

from __future__ import annotations

import pytest

from fastdeploy.entrypoints import launch
from fastdeploy.entrypoints.engine_client.async_engine import QueueFullError
from fastdeploy.entrypoints.openai.api_workers import concurrency_share


def test_the_concurrency_shares_add_up_and_never_reach_zero():
    assert [concurrency_share(10, 3, i) for i in range(3)] == [4, 3, 3]
    assert sum(concurrency_share(512, 7, i) for i in range(7)) == 512
    assert concurrency_share(1, 1, 0) == 1
    with pytest.raises(ValueError, match="index=3, count=3 is invalid"):
        concurrency_share(10, 3, 3)


def test_a_full_share_says_which_limit_it_is():
    text = str(QueueFullError(2, limit="this API server process's share of --max-concurrency=4"))
    assert "limit of 2 concurrent requests (this API server process's share" in text
    assert "(--max-concurrency)" in str(QueueFullError(4))


def test_an_earlier_runs_metrics_files_are_removed_from_a_given_directory(tmp_path, monkeypatch):
    (tmp_path / "counter_123.db").write_bytes(b"stale")
    (tmp_path / "notes.txt").write_text("kept")
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    launch.multiprocess_metrics_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_a_ctrl_c_taken_by_another_thread_waits_until_every_worker_has_started(monkeypatch):
    """SIGINT is blocked on the starting thread only; when another thread of the process takes
    it, Python raises KeyboardInterrupt on the main thread at its next instruction. While the
    workers start, that used to be half way through writing a child's start-up data (the child
    then died with "EOFError: Ran out of input", seen in CI). Now it waits for the end of
    ``_start`` and is raised after."""
    import os
    import signal
    import threading
    import time

    from fastdeploy.entrypoints.openai.api_workers import APIServerWorkers

    go, sent = threading.Event(), threading.Event()

    def other_thread() -> None:  # started before the mask: SIGINT is not blocked here
        go.wait(10)
        os.kill(os.getpid(), signal.SIGINT)
        sent.set()

    progress: list[str] = []

    def start(self, *args) -> None:
        progress.append("begun")
        go.set()
        sent.wait(10)
        time.sleep(0.2)  # the interpreter checks for signals many times in here
        progress.append("every worker started")

    monkeypatch.setattr(APIServerWorkers, "_start", start)
    thread = threading.Thread(target=other_thread, daemon=True)
    thread.start()
    with pytest.raises(KeyboardInterrupt):
        APIServerWorkers(None, None, [], None, None)
    thread.join(5)
    assert progress == ["begun", "every worker started"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
