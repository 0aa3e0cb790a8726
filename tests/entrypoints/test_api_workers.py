"""The pieces of ``--api-server-count`` that need no server: the share of ``--max-concurrency``,
the 429 text that names it, and the metrics directory an earlier run left files in."""

from __future__ import annotations

import pytest

from fastdeploy.engine.async_engine import QueueFullError
from fastdeploy.entrypoints.openai import api_server
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
    api_server._multiprocess_metrics_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
