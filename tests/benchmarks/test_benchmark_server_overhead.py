"""benchmarks/benchmark_server_overhead.py, small, with the tests' character tokenizer: both modes
(in-process handlers; HTTP with the raw client in a subprocess) stream every token and report
consistent numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support import load_benchmark_module

ROOT = Path(__file__).resolve().parents[2]


def load_benchmark():
    return load_benchmark_module("benchmark_server_overhead")


@pytest.mark.parametrize(
    "mode",
    [
        pytest.param(["--no-http"], id="no-http"),
        pytest.param([], id="http", marks=pytest.mark.slow),  # the SSE client in a process
    ],
)
def test_small_run_streams_every_token(mode, tmp_path, capsys):
    bench = load_benchmark()
    out = tmp_path / "run.json"
    result = bench.main(
        ["--tokenizer", "fake", "--num-prompts", "6", "--concurrency", "3", "--input-len", "12",
         "--output-len", "5", "--step-ms", "0.5", "--json", str(out), *mode]
    )  # fmt: skip
    assert result["tokens"] == 6 * 5
    assert result["steps"] >= 2 * 5  # two waves of three streams
    assert result["offline_tok_s"] > 0 and result["served_tok_s"] > 0
    assert result["asyncio_cpu_s"] > 0 and result["engine_cpu_s"] > 0
    assert 0 < result["tpot_p50_ms"] < 1000
    assert json.loads(out.read_text())["result"]["tokens"] == 30
    printed = capsys.readouterr().out
    assert "served / offline" in printed and "asyncio CPU per 3-stream step (ms)" in printed


def test_synthetic_engine_detokenizes_like_the_engine():
    bench = load_benchmark()
    from fastdeploy.core.sampling_params import SamplingParams

    tokenizer = bench.load_tokenizer("fake")
    engine = bench.SyntheticEngine(tokenizer, step_s=0.0)
    engine.add_request("a", [65, 66], SamplingParams(max_tokens=4, stop=["zz"]))
    outputs = [o for _ in range(4) for o in engine.step()]
    assert [o.finished for o in outputs] == [False, False, False, True]
    text = "".join(o.new_text for o in outputs)
    ids = [o.new_token_ids[0] for o in outputs]
    assert text == tokenizer.decode(ids) and not engine.has_unfinished_requests()
