"""benchmarks/benchmark_throughput.py shows its progress on stderr (a CPU run takes minutes and
printed nothing until its table: a first-hour friction of issue #44) and keeps stdout for the
table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import tiny_llama

ROOT = Path(__file__).resolve().parents[2]


def run_benchmark(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    model = tmp_path / "tiny"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(tiny_llama()))
    args = [
        sys.executable, str(ROOT / "benchmarks" / "benchmark_throughput.py"), "--model",
        str(model), "--load-format", "dummy", "--device", "cpu", "--skip-tokenizer-init",
        "--max-model-len", "512", "--num-prompts", "6", "--input-len", "16", "--output-len", "4",
        "--range-ratio", "0", *extra,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.mark.slow
def test_progress_on_stderr_and_the_table_on_stdout(tmp_path):
    done = run_benchmark(tmp_path)
    assert "loading " in done.stderr and "warm-up: 4 requests" in done.stderr
    assert "timed run: 6 requests" in done.stderr
    assert "Processed prompts" in done.stderr and "6/6" in done.stderr  # the tqdm bar
    assert "Processed prompts" not in done.stdout
    assert "output tokens/s" in done.stdout and "6 requests" in done.stdout

    quiet = run_benchmark(tmp_path, "--disable-tqdm")
    assert "Processed prompts" not in quiet.stderr and "timed run" in quiet.stderr
    assert "output tokens/s" in quiet.stdout
