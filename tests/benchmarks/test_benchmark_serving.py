"""benchmarks/benchmark_serving.py against our server with the fake engine: every request
completes with the asked lengths, and the summary's numbers are consistent."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import httpx
import pytest
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

    async def recording(client, url, model, prompt, max_tokens, fields=None):
        sent.append(tuple(prompt))
        return await real(client, url, model, prompt, max_tokens, fields)

    bench.run_one = recording
    with serve_in_thread(FakeEngine(step_delay_s=0.001)) as (url, _):
        summary = bench.main(
            ["--base-url", url, "--num-prompts", "3", "--input-len", "12", "--output-len", "2",
             "--concurrency", "1", "--vocab-size", "256", "--warmup", "2"]
        )  # fmt: skip
    assert summary["completed"] == 3 and len(sent) == 5
    assert not set(sent[:2]) & set(sent[2:])


@pytest.mark.slow
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
             "--request-rate", "40", "--vocab-size", "256", "--num-clients", "2",
             "--json-schema", '{"type": "integer"}']
        )  # fmt: skip
        assert summary["completed"] == 4 and summary["output_tokens"] == 12
        # the schema reached both client processes: every request carried it and kept its text
        assert summary["schema_checked"] == 4 and summary["schema_valid"] is not None
    try:
        bench.main(["--num-clients", "5", "--concurrency", "4"])
    except SystemExit as e:
        assert "--num-clients=5" in str(e) and "1..min" in str(e) and "= 4" in str(e)
    else:
        raise AssertionError("5 client processes for 4 streams were not refused")


CACHE_LINE = "prompt tokens from the server's prefix cache:"
CACHE_WARNING = "TTFT includes prefix-cache hits"


def test_prefix_cache_hits_are_counted_and_warned_about(capsys):
    """The same --seed twice: the second run's prompts are all in the server's prefix cache
    (whole 16-token blocks below the last token: 32 of each 40-token prompt), and the table says
    so and warns; another seed, or the first run, prints 0 and no warning. A longer --input-len
    with the first seed begins with its prompts again."""
    bench = load_benchmark()
    common = ["--num-prompts", "4", "--input-len", "40", "--output-len", "3", "--concurrency",
              "2", "--vocab-size", "256", "--warmup", "1"]  # fmt: skip
    with serve_in_thread(FakeEngine(step_delay_s=0.001, prefix_block_size=16)) as (url, _):
        first = bench.main(["--base-url", url, "--seed", "3", *common])
        printed = capsys.readouterr().out
        assert first["completed"] == 4 and first["cached_prompt_tokens"] == 0
        assert f"{CACHE_LINE} 0 of 160 (0.0%)" in printed and CACHE_WARNING not in printed

        again = bench.main(["--base-url", url, "--seed", "3", *common])
        printed = capsys.readouterr().out
        assert again["completed"] == 4 and again["cached_prompt_tokens"] == 4 * 32
        assert f"{CACHE_LINE} 128 of 160 (80.0%)" in printed
        assert CACHE_WARNING in printed and "another --seed" in printed

        other = bench.main(["--base-url", url, "--seed", "4", *common])
        printed = capsys.readouterr().out
        assert other["cached_prompt_tokens"] == 0 and CACHE_WARNING not in printed

        longer = bench.main(["--base-url", url, "--seed", "3", *common, "--input-len", "64"])
        assert longer["cached_prompt_tokens"] >= 32  # at least the first prompt's 2 blocks
        assert CACHE_WARNING in capsys.readouterr().out


def test_servers_without_cached_tokens_print_no_cache_line(capsys):
    """A usage without ``prompt_tokens_details`` (an older server) counts as unknown: no line,
    no warning; a reported count is summed over the completed requests only."""
    bench = load_benchmark()

    def older_server(request: httpx.Request) -> httpx.Response:
        usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
        events = [{"choices": [{"text": "a"}], "usage": None}, {"choices": [], "usage": usage}]
        body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, text=body)

    async def one() -> object:
        async with httpx.AsyncClient(transport=httpx.MockTransport(older_server)) as client:
            return await bench.run_one(client, "http://x/v1/completions", "m", [11, 12, 13], 1)

    result = asyncio.run(one())
    assert result.error is None and result.output_len == 1
    assert result.cached_tokens == 0 and not result.cached_tokens_reported

    args = bench.build_parser().parse_args([])
    unknown = [bench.RequestResult(40, 3, 0.01, 0.02, [0.005] * 2)] * 3
    summary = bench.summarize(unknown, 1.0)
    assert summary["cached_prompt_tokens"] is None
    bench.print_table(summary, args, "m")
    printed = capsys.readouterr().out
    assert "TTFT" in printed and CACHE_LINE not in printed and CACHE_WARNING not in printed

    reported = [
        bench.RequestResult(40, 3, 0.01, 0.02, cached_tokens=32, cached_tokens_reported=True),
        bench.RequestResult(40, 3, 0.01, 0.02, cached_tokens=0, cached_tokens_reported=True),
        bench.RequestResult(40, error="HTTP 500", cached_tokens=16, cached_tokens_reported=True),
    ]
    summary = bench.summarize(reported, 1.0)
    assert summary["cached_prompt_tokens"] == 32 and summary["input_tokens"] == 80
    bench.print_table(summary, args, "m")
    printed = capsys.readouterr().out
    assert f"{CACHE_LINE} 32 of 80 (40.0%)" in printed and CACHE_WARNING in printed
