"""benchmarks/benchmark_startup.py: its helpers, and one run against the default model on CPU
(no graphs there: the capture columns say n/a)."""

from __future__ import annotations

import io

import pytest
from support import load_benchmark_module

bench = load_benchmark_module("benchmark_startup")


def test_log_marks_take_the_first_line_of_each_kind():
    ticks = iter([1.0, 2.0, 3.0, 4.0])
    log = io.StringIO(
        "INFO loaded /m/x.gguf: 30 layers, dtype float32\n"
        "INFO KV cache: 100 blocks x 16 tokens\n"
        "INFO KV cache: 200 blocks x 16 tokens\n"
        "INFO background capture done: 8 of 8 graphs captured\n"
    )
    marks: dict = {}
    bench.mark_log_lines(log, 0.5, marks, clock=lambda: next(ticks))
    assert marks == {"weights_loaded": 0.5, "kv_allocated": 1.5, "capture_done": 3.5}


def test_tpot_is_split_at_the_end_of_capture():
    times = [10.0, 10.1, 10.3, 10.5, 10.55, 10.6]
    during, after = bench.split_tpot(times, 10.5)
    assert during == pytest.approx(1000 * 0.5 / 3) and after == pytest.approx(50.0)
    assert bench.split_tpot(times, None) == (pytest.approx(120.0), None)
    assert bench.mean_gap_ms([1.0]) is None


def test_checks_judge_only_what_was_measured():
    r = bench.Startup(weights_loaded=10.0, first_token=11.5, health=11.0, all_captured=15.0,
                      tpot_during_capture_ms=3.0, tpot_after_capture_ms=1.0)  # fmt: skip
    assert [ok for _, ok in r.checks()] == [True, True, None, False]
    assert [ok for _, ok in bench.Startup(weights_loaded=1.0).checks()] == [None] * 4
    timed = bench.Startup(
        serving_before_capture=20.0, capture_done_log=25.9, blocking_capture_s=5.0
    )
    assert timed.background_capture_wall_s == pytest.approx(5.9)
    assert [ok for _, ok in timed.checks()][2] is True  # 5.9 <= 1.2 * 5.0
    timed.blocking_capture_s = 4.0
    assert [ok for _, ok in timed.checks()][2] is False  # 5.9 > 4.8


def test_capture_is_over_only_once_the_engine_said_so():
    assert bench.capture_over({}) is False  # no report yet (right after /health): keep polling
    assert bench.capture_over({"steps_by_mode": {}}) is True  # a report without graphs
    assert bench.capture_over({"graph_capture": {"done": False, "captured": 3}}) is False
    assert bench.capture_over({"graph_capture": {"done": True}}) is True


def test_the_blocking_run_keeps_the_other_graph_keys():
    import json
    import shlex

    def config_of(args):
        parts = shlex.split(args)
        return [json.loads(p.split("=", 1)[1]) if p.startswith("--graph-optimization-config=")
                else json.loads(parts[i + 1]) for i, p in enumerate(parts)
                if p.startswith("--graph-optimization-config")]  # fmt: skip

    plain = bench.with_blocking_capture("--model m --max-model-len 512")
    assert config_of(plain) == [{"capture_in_background": False}]
    given = bench.with_blocking_capture("--graph-optimization-config '{\"graph_opt_level\": 0}'")
    assert config_of(given) == [{"graph_opt_level": 0, "capture_in_background": False}]
    joined = bench.with_blocking_capture("--graph-optimization-config='{\"use_cudagraph\": true}'")
    assert config_of(joined) == [{"use_cudagraph": True, "capture_in_background": False}]


@pytest.mark.slow
def test_a_cpu_run_orders_the_start_up_marks():
    r = bench.run("--max-model-len 512", max_tokens=4, timeout_s=300)
    assert r.weights_loaded < r.kv_allocated <= r.engine_ready <= r.http_started
    # The log line and the /health poll are timed by two threads: a few ms either way.
    assert r.engine_ready <= r.health and abs(r.health - r.http_started) < 1.0
    assert r.health <= r.first_token
    assert r.graphs is None and r.all_captured is None  # no graphs on CPU
    assert r.tpot_after_capture_ms > 0
    assert "first token (sent at 0)" in bench.report(r)
