"""benchmarks/benchmark_serving.py against our server with the fake engine: every request
completes with the asked lengths, and the summary's numbers are consistent."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from support import load_benchmark_module

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "entrypoints"))

from fake_llm_engine import FakeEngine  # noqa: E402
from http_server_utils import serve_in_thread  # noqa: E402


def load_benchmark():
    return load_benchmark_module("benchmark_serving")


def test_closed_and_open_loop_runs(tmp_path, capsys):
    bench = load_benchmark()
    with serve_in_thread(FakeEngine(step_delay_s=0.002)) as (url, _):
        out = tmp_path / "run.json"
        summary = bench.main(
            ["--base-url", url, "--num-prompts", "12", "--input-len", "20", "--output-len", "9",
             "--concurrency", "4", "--vocab-size", "256", "--warmup", "1", "--json", str(out)]
        )  # fmt: skip
        assert summary["completed"] == 12 and summary["failed"] == 0
        assert summary["output_tokens"] == 12 * 9 and summary["input_tokens"] == 12 * 20
        assert 0 < summary["ttft_ms"]["p50"] <= summary["e2e_ms"]["p50"]
        assert summary["itl_ms"]["mean"] > 0 and summary["tpot_ms"]["mean"] > 0
        saved = json.loads(out.read_text())
        assert len(saved["results"]) == 12
        assert all(len(r["itl"]) == 8 for r in saved["results"])  # one gap per later token
        steps = summary["engine_steps"]  # from the server's /metrics around the timed run
        assert set(steps["steps"]) == {"full", "piecewise", "eager"}
        assert steps["steps"]["eager"] > 0 and steps["steps"]["full"] == 0
        # 108 tokens from at most 4 running requests a step (the fake engine: one token each)
        assert 1.0 <= steps["tokens_per_step"] <= 4.0
        assert steps["steps"]["eager"] >= 12 * 9 / 4
        assert steps["ms_per_step"] == summary["seconds"] * 1000 / steps["steps"]["eager"]
        printed = capsys.readouterr().out
        assert "TTFT" in printed and "output tok/s" in printed
        assert "output tokens/step" in printed
        summary = bench.main(
            ["--base-url", url, "--num-prompts", "6", "--input-len", "10", "--output-len", "4",
             "--range-ratio", "0.5", "--request-rate", "50", "--vocab-size", "256"]
        )  # fmt: skip
        assert summary["completed"] == 6 and summary["failed"] == 0


def test_engine_steps_are_left_out_for_servers_without_our_metrics():
    bench = load_benchmark()
    assert bench.server_counters("http://127.0.0.1:9") is None  # nothing listens there
    assert bench.step_summary(None, {"generation_tokens": 5.0}, 1.0) is None
    got = bench.step_summary(
        {"steps:full": 10.0, "generation_tokens": 100.0},
        {"steps:full": 30.0, "steps:eager": 5.0, "generation_tokens": 800.0},
        0.5,
    )
    assert got == {"steps": {"full": 20, "eager": 5}, "tokens_per_step": 28.0,
                   "ms_per_step": 20.0}  # fmt: skip


def test_warmup_prompts_are_never_timed_prompts():
    """A timed prompt sent during warm-up would be a prefix-cache hit, its TTFT no prefill's."""
    bench = load_benchmark()
    sent = []
    real = bench.run_one

    async def recording(client, url, model, prompt, max_tokens):
        sent.append(tuple(prompt))
        return await real(client, url, model, prompt, max_tokens)

    bench.run_one = recording
    with serve_in_thread(FakeEngine(step_delay_s=0.001)) as (url, _):
        summary = bench.main(
            ["--base-url", url, "--num-prompts", "3", "--input-len", "12", "--output-len", "2",
             "--concurrency", "1", "--vocab-size", "256", "--warmup", "2"]
        )  # fmt: skip
    assert summary["completed"] == 3 and len(sent) == 5
    assert not set(sent[:2]) & set(sent[2:])


def test_client_processes_share_the_load():
    """--num-clients 2: every prompt is sent once, from two processes, and the summary counts
    all of them; a count above the concurrency is refused naming the limit."""
    bench = load_benchmark()
    with serve_in_thread(FakeEngine(step_delay_s=0.002)) as (url, async_engine):
        summary = bench.main(
            ["--base-url", url, "--num-prompts", "10", "--input-len", "8", "--output-len", "5",
             "--concurrency", "4", "--vocab-size", "256", "--warmup", "1", "--num-clients", "2"]
        )  # fmt: skip
        assert summary["completed"] == 10 and summary["failed"] == 0
        assert summary["output_tokens"] == 50 and summary["input_tokens"] == 80
        assert summary["tpot_ms"]["p50"] > 0
        summary = bench.main(
            ["--base-url", url, "--num-prompts", "4", "--input-len", "8", "--output-len", "3",
             "--request-rate", "40", "--vocab-size", "256", "--num-clients", "2"]
        )  # fmt: skip
        assert summary["completed"] == 4 and summary["output_tokens"] == 12
    try:
        bench.main(["--num-clients", "5", "--concurrency", "4"])
    except SystemExit as e:
        assert "--num-clients=5" in str(e) and "1..min" in str(e) and "= 4" in str(e)
    else:
        raise AssertionError("5 client processes for 4 streams were not refused")
