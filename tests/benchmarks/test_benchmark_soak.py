"""benchmarks/benchmark_soak.py for a few seconds against the fake engine served in a thread
(``--url``): rows are printed with every column, the outcomes add up and it passes; and its
verdict fails a soak with errors, RSS growth, blocks left used or a bad /health."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "entrypoints"))

from fake_llm_engine import FakeEngine  # noqa: E402
from http_server_utils import serve_in_thread  # noqa: E402
from support import load_benchmark_module  # noqa: E402

soak = load_benchmark_module("benchmark_soak")


def test_a_short_soak_against_a_running_server_passes(capsys):
    engine = FakeEngine(max_model_len=128, num_blocks=64, step_delay_s=0.002)
    with serve_in_thread(engine, max_concurrency=24) as (url, _):
        status = soak.main(
            ["--url", url, "--duration", "3", "--report-every", "1", "--streams", "16",
             "--burst", "40", "--burst-every", "2", "--max-tokens", "6"]
        )  # fmt: skip
    out = capsys.readouterr().out
    assert status == 0, out
    header = next(line for line in out.splitlines() if line.split()[:2] == ["elapsed_s", "ok"])
    assert header.split() == list(soak.COLUMNS)
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) >= 3, out  # one a second, and the end
    ok, aborted, refused, errors = (int(v) for v in rows[-1][1:5])
    assert errors == 0 and ok > 0 and aborted > 0 and refused > 0, rows[-1]
    assert rows[-1][7:10] == ["0", "64", "200"], rows[-1]  # KV used, free, health at the end
    assert float(rows[-1][5]) > 0 and float(rows[-1][6]) > 0  # this process's RSS: both
    assert "PASS" in out


def test_the_verdict_names_each_problem():
    good = {"server_MiB": 400.0, "engine_MiB": 2000.0, "kv_used": 0, "health": 200}
    result = soak.LoadResult(counts=Counter(ok=10))
    assert soak.verdict(good, dict(good), result, 0.10) == []
    assert soak.verdict(good, {**good, "engine_MiB": 2199.0}, result, 0.10) == []
    bad_end = {**good, "server_MiB": 460.0, "kv_used": 3, "health": 503}
    result.add("error", "HTTP 500: boom")
    problems = soak.verdict(good, bad_end, result, 0.10)
    assert len(problems) == 4, problems
    assert "1 request(s) ended in error" in problems[0] and "HTTP 500" in problems[0]
    assert "server RSS grew +15.0% (400 -> 460 MiB)" in problems[1]
    assert "3 used" in problems[2] and "503" in problems[3]
