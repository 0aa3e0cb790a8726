"""benchmarks/step_trace: the traced offline benchmark writes one record per engine step with its
parts, and step_trace_report.py turns records into per-mode tables."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support import load_benchmark_module
from tiny_models import tiny_llama

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_an_offline_run_on_cpu_writes_a_record_per_step(tmp_path):
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(tiny_llama()))
    prefix = tmp_path / "trace"
    env = {
        **os.environ,
        "STEP_TRACE": str(prefix),
        "PYTHONPATH": os.pathsep.join([str(ROOT / "benchmarks" / "step_trace"), str(ROOT)]),
    }
    args = [
        sys.executable, str(ROOT / "benchmarks" / "benchmark_throughput.py"), "--model",
        str(model), "--load-format", "dummy", "--device", "cpu", "--skip-tokenizer-init",
        "--max-model-len", "512", "--num-prompts", "4", "--input-len", "16", "--output-len", "5",
        "--range-ratio", "0",
    ]  # fmt: skip
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "step trace:" not in done.stderr  # every CPU-side part was found and wrapped
    (trace,) = tmp_path.glob("trace.*.jsonl")
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    # One output per request and token, of the warm-up (the same 4 prompts) and the timed run.
    assert sum(r["nout"] for r in records) == 2 * 4 * 5
    stepped = [r for r in records if "mode" in r]
    assert stepped and {r["mode"] for r in stepped} == {"eager"}  # CPU: no graphs
    for r in stepped:
        assert r["n_schedule"] == 1 and r["n_launch"] == 1 and r["n_prepare"] == 1
        assert 0 < r["prepare"] < r["launch"] < r["dt"]
    # Each step's tokens are waited for once, inside finish (a step later: overlap schedule).
    finished = [r for r in records if "finish" in r]
    assert finished and all(r["n_wait"] == 1 and 0 < r["wait"] < r["finish"] for r in finished)
    assert sum(r["ntok"] for r in stepped) == 2 * (4 * 16 + 4 * 4)  # prompts, 4 decode tokens
    report = load_benchmark_module("step_trace_report")
    table = report.report(trace)
    assert f"{len(stepped)} steps" in table and "| eager | " in table


def run_traced(tmp_path, prefix: str, script: str) -> subprocess.CompletedProcess:
    model = tmp_path / "tiny"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(tiny_llama()))
    env = {
        **os.environ,
        "STEP_TRACE": prefix,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "benchmarks" / "step_trace"), str(ROOT)]),
    }
    code = (
        "import sitecustomize as trace\n"
        "from fastdeploy.entrypoints.llm import LLM\n"
        "from fastdeploy.core.sampling_params import SamplingParams\n"
        f"llm = LLM(model={str(model)!r}, load_format='dummy', device='cpu', "
        "skip_tokenizer_init=True, max_model_len=512)\n"
        f"{script}\n"
        "outs = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=6, "
        "ignore_eos=True), use_tqdm=False)\n"
        "print('tokens', len(outs[0].outputs[0].token_ids))\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow
def test_a_trace_that_cannot_be_written_never_stops_the_traced_process(tmp_path):
    # Refused at start: a prefix that names a directory, or a directory that does not exist.
    for prefix in (f"{tmp_path}/", f"{tmp_path}/missing/tr"):
        done = run_traced(tmp_path, prefix, "")
        assert done.returncode == 0 and "tokens 6" in done.stdout, done.stderr[-2000:]
        assert "step trace: not installed" in done.stderr and "writable directory" in done.stderr
    # A write that fails after the start (the directory is gone) stops the trace, not the run.
    gone = tmp_path / "gone"
    gone.mkdir()
    script = f"import shutil; shutil.rmtree({str(gone)!r}); trace.FLUSH_EVERY = 1"
    done = run_traced(tmp_path, f"{gone}/tr", script)
    assert done.returncode == 0 and "tokens 6" in done.stdout, done.stderr[-2000:]
    assert done.stderr.count("step trace: stopped, cannot write") == 1


def test_the_report_skips_a_torn_line_and_reports_unreadable_files(tmp_path, capsys):
    report = load_benchmark_module("step_trace_report")
    good = {"t0": 1.0, "dt": 0.002, "mode": "full", "nreq": 2, "ntok": 2, "nout": 2}
    torn = tmp_path / "t.2.jsonl"
    torn.write_text(json.dumps(good) + "\n" + json.dumps(good)[:20])  # killed mid-write
    report.main([str(torn), str(tmp_path / "missing.jsonl")])
    captured = capsys.readouterr()
    assert captured.out.startswith(f"{torn}: 1 steps")
    assert f"{tmp_path / 'missing.jsonl'}: cannot read" in captured.out
    assert f"{torn}:2: skipped, not a step record" in captured.err


def test_the_report_splits_decode_steps_by_whether_they_re_planned(tmp_path, capsys):
    report = load_benchmark_module("step_trace_report")

    def step(t0, mode, dt, **parts):
        return {"t0": t0, "dt": dt, "mode": mode, "nreq": 4, "ntok": 4, "nout": 4, **parts}

    records = [
        step(10.0, "piecewise", 0.003, prepare=0.001, n_plan=1, plan=0.0002),
        step(10.01, "full", 0.002, prepare=0.0005, n_plan=1, plan=0.0001),  # re-planned
        step(10.02, "full", 0.001, prepare=0.0005),  # kept its plan
        step(10.03, "full", 0.001, prepare=0.0005, n_plan_dec_direct=1, plan_dec_direct=0.00005),
    ]
    path = tmp_path / "t.1.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in reversed(records)))  # any order
    report.main([str(path)])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"{path}: 4 steps over 0.03 s, 0.01 s in steps")
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in lines[3:]}
    assert rows["full"][1] == "3" and rows["full, re-planned"][1] == "2"
    assert rows["full, plan kept"][1] == "1" and rows["full, plan kept"][5] == "1.000"
    assert rows["piecewise"][5] == "3.000"
    assert report.report(path, skip_s=0.015).startswith(f"{path}: 2 steps")


@pytest.mark.slow
def test_the_engine_loop_of_a_server_records_drain_stats_and_emit(tmp_path):
    """The parts around a step in the engine process's loop (served only): the commands drained
    before it, the counters read after it and the send of its message."""
    script = (
        "import multiprocessing, queue, threading\n"
        "from fastdeploy.core.messages import AddRequest, StepOutputs, StopLoop\n"
        "from fastdeploy.engine.engine_core_proc import PipeEmitter\n"
        "from fastdeploy.engine.engine_loop import EngineLoop\n"
        "commands = queue.SimpleQueue()\n"
        "recv, send = multiprocessing.Pipe(duplex=False)\n"
        "def read():\n"
        "    while True:\n"
        "        m = recv.recv()\n"
        "        if isinstance(m, StepOutputs) and any(o.finished for o in m.outputs):\n"
        "            return commands.put(StopLoop())\n"
        "threading.Thread(target=read, daemon=True).start()\n"
        "params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)\n"
        "commands.put(AddRequest('a', [5, 6, 7], params))\n"
        "commands.put(AddRequest('b', [8, 9], params))\n"
        "EngineLoop(llm.engine, commands, PipeEmitter(send, commands)).run()\n"
    )
    script = "from fastdeploy.core.sampling_params import SamplingParams\n" + script
    done = run_traced(tmp_path, str(tmp_path / "tr"), script)
    assert done.returncode == 0 and "tokens 6" in done.stdout, done.stderr[-3000:]
    (trace,) = tmp_path.glob("tr.*.jsonl")
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    # The loop's 5 steps (overlap schedule: a step's tokens come out with the next one, the
    # last step only finishes the one before), then those of the generate() call.
    looped, generated = records[:5], records[5:]
    assert [r["nout"] for r in looped] == [0, 2, 2, 2, 2] and "mode" not in looped[4]
    assert all(r["emit"] > 0 and r["stats"] > 0 for r in looped)
    # The loop blocked for the first commands (both adds: idle time, not timed); the drains
    # before the later steps did not block, found no command and were timed.
    assert "drain" not in looped[0]
    assert all(r["drain"] > 0 and r["n_drain"] == 0 for r in looped[1:])
    assert generated and not any({"emit", "stats", "drain"} & set(r) for r in generated)
    # The loop applied both requests (request events; generate() adds without the loop).
    (req_trace,) = tmp_path.glob("tr-req.*.jsonl")
    added = [json.loads(line) for line in req_trace.read_text().splitlines()]
    assert [r["rid"] for r in added] == ["a", "b"]
    assert all(0 < r["add"] < looped[1]["t0"] for r in added)  # before the step that ran them


def test_the_request_report_joins_client_and_server_events(tmp_path, capsys):
    report = load_benchmark_module("request_trace_report")

    def result(rid, start, ttft, e2e, stream=0):
        return {"request_id": rid, "start": start, "ttft": ttft, "e2e": e2e, "stream": stream,
                "error": None}  # fmt: skip

    client = tmp_path / "client.json"
    results = [
        result("r1", 10.0, 0.020, 0.200),
        result("r2", 10.203, 0.010, 0.100),
        result("lost", 11.0, 0.01, 0.1),  # not in the traces
        {**result("bad", 12.0, 0, 0), "error": "HTTP 500"},
    ]
    client.write_text(json.dumps({"results": results}))
    server = tmp_path / "srv-req.1.jsonl"  # the API server process
    server.write_text(
        json.dumps({"rid": "r1", "create": 10.001, "admit": 10.002, "first_end": 10.015,
                    "first_recv": 10.016, "sse_first": 10.017, "fin_end": 10.196,
                    "fin_recv": 10.197, "sse_end": 10.198}) + "\n"
        + json.dumps({"rid": "r2", "create": 10.204, "admit": 10.2045}) + "\n"
    )  # fmt: skip
    engine = tmp_path / "srv-req.2.jsonl"  # the engine process
    engine.write_text(json.dumps({"rid": "r1", "add": 10.004}) + "\n"
                      + json.dumps({"rid": "r2", "add": 10.206}) + "\n")  # fmt: skip
    text = report.main([str(client), str(server), str(engine)])
    rows = {line[:45].strip(): line[45:].split() for line in text.splitlines()[1:]}
    assert text.splitlines()[1] == "first token, 2 requests (ms)"
    assert rows["client send -> handler"] == ["1.000", "1.000", "1.000", "2"]  # r2: 1 ms too
    assert rows["queued -> engine applied"][3] == "2"
    assert rows["engine applied -> first token's step end"] == ["11.000", "11.000", "11.000", "1"]
    assert rows["TTFT (client)"][3] == "2"
    assert rows["client: end -> next send"] == ["3.000", "3.000", "3.000", "1"]
    assert rows["slot gap (last step end -> next applied)"] == ["10.000", "10.000", "10.000", "1"]
    other = tmp_path / "other-req.3.jsonl"  # another run's trace: no id in common
    other.write_text(json.dumps({"rid": "x", "add": 1.0}) + "\n")
    with pytest.raises(SystemExit, match="no request"):
        report.main([str(client), str(other)])
