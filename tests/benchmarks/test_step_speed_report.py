"""benchmarks/step_speed_report.py reads one run's JSON files into the step-speed table, and
run_step_speed.sh's report part prints it (the GPU parts run on a CUDA host only)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from support import load_benchmark_module

ROOT = Path(__file__).resolve().parents[2]


def write(directory: Path, name: str, payload: dict) -> None:
    (directory / name).write_text(json.dumps(payload))


def peers_row(system: str, model: str, batch: int, tok_s: float, ms: float, error=None) -> dict:
    return {"system": system, "model": model, "batch": batch, "tok_s": tok_s, "ms_step": ms,
            "startup_s": 1.0, "warmup_s": 0.0, "error": error}  # fmt: skip


def full_run(d: Path) -> None:
    rows = [
        peers_row("fastdeploy-graph", "smollm2-135m", 1, 1100.0, 0.9),
        peers_row("fastdeploy-graph", "smollm2-135m", 16, 16000.0, 1.0),
        peers_row("fastdeploy-graph", "smollm2-135m", 64, 56000.0, 1.7),  # misses 1.6
        peers_row("fastdeploy-graph", "llama3-8b", 1, 225.0, 4.44),
        peers_row("fastdeploy-graph", "llama3-8b", 16, 3400.0, 4.7),
        peers_row("fastdeploy-graph", "llama3-8b", 64, 10600.0, 6.0),
        peers_row("hf-compile", "smollm2-135m", 16, 5000.0, 3.2),
        peers_row("hf-compile", "smollm2-135m", 64, 14000.0, 4.5),
        peers_row("hf-compile", "llama3-8b", 16, 1800.0, 8.8),
        peers_row("hf-compile", "llama3-8b", 64, 4900.0, 13.0, error="OOM"),  # failed: no ratio
    ]
    write(d, "peers.json", {"rows": rows})
    for model, pw in (("smollm2-135m", 0.99), ("llama3-8b", 4.4)):
        write(d, f"prefill_{model}.json", {
            "rows": [{"tokens": 16, "piecewise_ms": pw}, {"tokens": 64, "piecewise_ms": 9.0}],
            "decode": [{"batch": 1, "graph_kernels": 275, "unfused_eager_kernels": 1122}],
        })  # fmt: skip
    workload = {"num_prompts": 2048, "input_len": 256, "output_len": 128}
    write(d, "served.json", {
        "args": {**workload, "range_ratio": 0.0},
        "summary": {"output_throughput": 27000.0, "tpot_ms": {"p50": 2.2}},
    })  # fmt: skip
    write(d, "offline.json", {**workload, "range_ratio": 0.0, "output_tok_s": 30000.0})


def by_name(rows) -> dict:
    return {r.name: r for r in rows}


def test_every_row_from_one_runs_files(tmp_path, capsys):
    report = load_benchmark_module("step_speed_report")
    full_run(tmp_path)
    rows = by_name(report.main([str(tmp_path), "--json", str(tmp_path / "table.json")]))
    assert len(rows) == 12
    expect = {
        "smollm2-135m decode step, batch 1 (ms)": (0.9, True),
        "smollm2-135m decode step, batch 64 (ms)": (1.7, False),
        "llama3-8b decode step, batch 1 (ms)": (4.44, True),
        "smollm2-135m prefill, 16 tokens, piecewise (ms)": (0.99, True),
        "llama3-8b prefill, 16 tokens, piecewise (ms)": (4.4, True),
        "smollm2-135m tok/s vs HF compile, batch 16 (x)": (16000 / 5000, True),
        "smollm2-135m tok/s vs HF compile, batch 64 (x)": (56000 / 14000, True),
        "llama3-8b tok/s vs HF compile, batch 16 (x)": (3400 / 1800, None),  # information
        "llama3-8b tok/s vs HF compile, batch 64 (x)": (None, None),  # the peer's row failed
        "served / offline output tok/s, 135M, 64 streams": (0.9, True),
        "served TPOT p50, 64 streams (ms)": (2.2, False),
        "smollm2-135m kernels per decode step, b1 (graph / unfused)": (275 / 1122, True),
    }
    for name, (value, met) in expect.items():
        assert rows[name].met is met, name
        assert rows[name].value == (None if value is None else pytest.approx(value)), name
    out = capsys.readouterr().out
    assert "8 of 10 measured rows met their goal; 0 not measured; 2 for information" in out
    assert rows["llama3-8b tok/s vs HF compile, batch 16 (x)"].goal == "info"
    assert "warning" not in out
    saved = json.loads((tmp_path / "table.json").read_text())
    assert [r["name"] for r in saved] == list(rows)


def test_missing_files_leave_rows_unmeasured_and_mismatches_warn(tmp_path, capsys):
    report = load_benchmark_module("step_speed_report")
    rows = report.main([str(tmp_path)])
    assert all(r.value is None and r.met is None for r in rows)
    assert "0 of 0 measured rows met their goal; 10 not measured; 2 for information" in (
        capsys.readouterr().out
    )
    full_run(tmp_path)
    write(tmp_path, "offline.json", {"num_prompts": 1024, "input_len": 256, "output_len": 128,
                                     "range_ratio": 0.5, "output_tok_s": 30000.0})  # fmt: skip
    report.main([str(tmp_path)])
    out = capsys.readouterr().out
    assert "warning: served num_prompts=2048 but offline num_prompts=1024" in out
    assert "different --range-ratio" in out


def test_bad_input_is_named(tmp_path):
    report = load_benchmark_module("step_speed_report")
    (tmp_path / "served.json").write_text("{not json")
    with pytest.raises(ValueError, match="served.json is not valid JSON"):
        report.main([str(tmp_path)])
    with pytest.raises(SystemExit, match="directory='.*nowhere' is invalid"):
        report.main([str(tmp_path / "nowhere")])


@pytest.mark.slow
def test_driver_report_part_and_unknown_part(tmp_path):
    script = ROOT / "benchmarks" / "run_step_speed.sh"
    full_run(tmp_path)
    done = subprocess.run(["bash", str(script), str(tmp_path), "report"], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "8 of 10 measured rows met their goal" in done.stdout
    bad = subprocess.run(["bash", str(script), str(tmp_path), "everything"], capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert bad.returncode == 2 and "unknown part 'everything'" in bad.stderr


@pytest.mark.slow
def test_driver_served_part_on_cpu(tmp_path):
    # The served and offline rows end to end with a tiny model on CPU: the server starts, the
    # serving benchmark drives it, the server stops (the driver's trap also stops it on failure),
    # the offline benchmark runs the same workload, and the report reads both files.
    import os
    import socket

    from tiny_models import tiny_llama

    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(tiny_llama()))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "SERVE_MODEL": str(model),
        "SERVE_ARGS": "--device cpu --skip-tokenizer-init --max-model-len 512",
        "NUM_PROMPTS": "8",
        "VOCAB_SIZE": "500",
        "PORT": str(port),
    }
    out = tmp_path / "run"
    script = ROOT / "benchmarks" / "run_step_speed.sh"
    done = subprocess.run(["bash", str(script), str(out), "served", "report"], env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    served = json.loads((out / "served.json").read_text())
    offline = json.loads((out / "offline.json").read_text())
    assert served["summary"]["completed"] == 8 and served["summary"]["output_tokens"] == 8 * 128
    assert offline["output_tokens"] == 8 * 128 and offline["num_prompts"] == 8
    assert "2 measured rows" in done.stdout and "warning" not in done.stdout
    host = json.loads((out / "host_served.json").read_text())  # the probe ran before the part
    assert host["loop_ms_best"] > 0 and host["repeats"] == 5
    assert "host before served:" in done.stdout
    with socket.socket() as s:  # the server is gone: its port is free again
        s.bind(("127.0.0.1", port))


def test_host_lines_under_the_table(tmp_path, capsys):
    report = load_benchmark_module("step_speed_report")
    full_run(tmp_path)
    write(tmp_path, "host_peers.json", {"loop_ms_best": 88.4, "cpu": "Xeon X", "cpu_count": 16})
    write(tmp_path, "host_served.json", {"loop_ms_best": 131.2, "cpu": "Xeon X", "cpu_count": 16})
    report.main([str(tmp_path)])
    out = capsys.readouterr().out.splitlines()
    lines = [line for line in out if line.startswith("host before")]
    assert lines == [
        "host before peers: Xeon X (16 cores), Python loop best 88 ms "
        "(host_speed.py; host-bound rows move with it)",
        "host before served: Xeon X (16 cores), Python loop best 131 ms "
        "(host_speed.py; host-bound rows move with it)",
    ]
    # A file without a number, or not an object, prints n/a instead of failing the report.
    write(tmp_path, "host_peers.json", {"loop_ms_best": None, "cpu": "Xeon X", "cpu_count": 16})
    (tmp_path / "host_served.json").write_text("[1, 2]")
    report.main([str(tmp_path)])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("host")]
    assert lines[0].startswith("host before peers: Xeon X (16 cores), Python loop best n/a")
    assert lines[1].startswith("host before served: n/a (n/a cores), Python loop best n/a")


def test_host_speed_probe(tmp_path):
    host_speed = load_benchmark_module("host_speed")
    result = host_speed.main(["--repeats", "2", "--json", str(tmp_path / "h.json")])
    assert 0 < result["loop_ms_best"] <= result["loop_ms_median"]
    assert result["repeats"] == 2 and result["cpu"] and result["cpu_count"] >= 1
    assert result["python"].count(".") == 2
    assert json.loads((tmp_path / "h.json").read_text()) == result
    with pytest.raises(SystemExit):
        host_speed.main(["--repeats", "0"])
    with pytest.raises(SystemExit):  # an unwritable --json: a usage error, not a traceback
        host_speed.main(["--repeats", "1", "--json", str(tmp_path / "missing" / "h.json")])


def test_host_speed_times_the_loop_at_module_level():
    # The quoted figures are of the loop as `python3 -c` runs it (global names), which is
    # slower than the same loop on a function's local names: the probe must time the former.
    host_speed = load_benchmark_module("host_speed")
    namespace: dict = {}
    exec(host_speed._LOOP_CODE, namespace)
    assert namespace["s"] == sum(range(host_speed.LOOP))
    assert "def " not in host_speed.LOOP_SOURCE
