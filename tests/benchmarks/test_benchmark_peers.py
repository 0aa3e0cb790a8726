"""benchmarks/benchmark_peers.py on CPU with a tiny Llama: our engine (graphs off) and
transformers eager each make every token, and the table and the JSON carry real numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support import load_benchmark_module
from tiny_models import tiny_llama

ROOT = Path(__file__).resolve().parents[2]

TINY = tiny_llama()


def load_benchmark():
    return load_benchmark_module("benchmark_peers")


def test_peers_smoke_on_cpu(tmp_path, capsys):
    pytest.importorskip("transformers")
    bench = load_benchmark()
    model = tmp_path / "tiny-llama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY))
    out = tmp_path / "peers.json"
    systems = ["fastdeploy-eager", "hf-eager"]
    rows = bench.main(
        ["--models", str(model), "--systems", *systems, "--batch-sizes", "1", "2",
         "--input-len", "8", "--output-len", "8", "--device", "cpu", "--dtype", "float32",
         "--json", str(out)]
    )  # fmt: skip
    assert [(r.system, r.batch) for r in rows] == [(s, b) for s in systems for b in (1, 2)]
    for r in rows:
        assert r.error is None, r.error
        assert r.tok_s > 0 and r.ms_step > 0 and r.startup_s > 0 and r.warmup_s > 0
        assert r.tok_s * r.ms_step / 1000 == pytest.approx(r.batch)  # B tokens per step
    saved = json.loads(out.read_text())
    assert saved["output_len"] == 8 and saved["input_len"] == 8
    assert [(r["system"], r["batch"]) for r in saved["rows"]] == [(r.system, r.batch) for r in rows]
    assert all(r["tok_s"] > 0 and r["error"] is None for r in saved["rows"])
    printed = capsys.readouterr().out
    lines = [ln.split() for ln in printed.splitlines()]
    table = [ln for ln in lines if ln and ln[0] in systems]
    assert len(table) == 4
    for ln in table:  # system, model, batch, tok/s, ms/step, start-up s, warm-up s (0.1 s units)
        assert ln[1] == "tiny-llama" and float(ln[3]) > 0 and float(ln[4]) > 0
        assert float(ln[5]) >= 0 and float(ln[6]) >= 0


def test_failing_system_is_a_row_not_a_crash(tmp_path, capsys, monkeypatch):
    bench = load_benchmark()

    def broken(self):
        raise RuntimeError("no such kernel")

    monkeypatch.setattr(bench.FastDeployPeer, "start", broken)
    model = tmp_path / "tiny-llama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY))
    rows = bench.main(
        ["--models", str(model), "--systems", "fastdeploy-graph", "--batch-sizes", "1", "4",
         "--device", "cpu"]
    )  # fmt: skip
    assert [r.batch for r in rows] == [1, 4]
    assert all(r.error == "RuntimeError: no such kernel" and r.tok_s is None for r in rows)
    assert "ERROR RuntimeError: no such kernel" in capsys.readouterr().out
