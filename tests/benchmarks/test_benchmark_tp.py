"""benchmarks/benchmark_tp.py on CPU over gloo with a tiny Llama: TP=1 and TP=2 time every size,
the fused column is skipped with the plan's reason, and the table prints."""

from __future__ import annotations

from pathlib import Path

import pytest
import transformers
from support import load_benchmark_module

ROOT = Path(__file__).resolve().parents[1].parent


def load_benchmark():
    return load_benchmark_module("benchmark_tp")


@pytest.mark.slow  # a process per TP rank
def test_tp1_and_tp2_over_gloo(tmp_path, capsys):
    cfg = transformers.LlamaConfig(
        vocab_size=250, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    )  # fmt: skip
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(tmp_path)
    bench = load_benchmark()
    results = bench.main(
        ["--model", str(tmp_path), "--device", "cpu", "--dtype", "float32", "--tokens", "16",
         "48", "--decode-batches", "1", "3", "--decode-context", "20", "--iters", "2",
         "--warmup", "1", "--max-num-seqs", "4", "--json", str(tmp_path / "out.json")]
    )  # fmt: skip
    for name in ("TP=1", "TP=2"):
        assert set(results[name]["prefill"]) == {16, 48}
        assert set(results[name]["decode"]) == {1, 3}
        for ms, mode in [*results[name]["prefill"].values(), *results[name]["decode"].values()]:
            assert ms > 0 and mode == "eager"  # no graphs on CPU
    fused = results["TP=2 fused"]
    assert fused["skipped"]
    assert fused["fusion_reasons"] == [
        "allreduce fusion off: platform 'cpu': flashinfer's fused all-reduce needs CUDA"
    ]
    out = capsys.readouterr().out
    assert "Prefill, 1 request of N tokens" in out and "Decode step, B requests" in out
    assert "CPU (gloo)" in out and (tmp_path / "out.json").exists()
