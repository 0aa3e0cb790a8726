"""benchmarks/benchmark_serving.py --json-schema without a real model: the schema's loading, the
request body, the output checking and the table, against a scripted stream and against our
server with the fake engine (which accepts the schema but ignores it: nothing it writes is JSON)."""

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

GOOD = {"name": "Ada", "role": "admin", "address": {"city": "Oslo", "zip": 150}, "tags": ["x"]}


@pytest.fixture(scope="module")
def bench():
    return load_benchmark_module("benchmark_serving")


@pytest.fixture(scope="module")
def check():
    return load_benchmark_module("schema_check")


def test_schema_is_loaded_inline_from_a_file_or_the_default(check, tmp_path):
    schema = check.load_json_schema(str(check.DEFAULT_SCHEMA))
    assert schema["properties"]["role"]["enum"] == ["admin", "editor", "viewer"]
    assert schema["properties"]["address"]["type"] == "object"  # nested
    assert schema["properties"]["tags"]["type"] == "array"
    assert check.load_json_schema(' {"type": "integer"} ') == {"type": "integer"}
    path = tmp_path / "s.json"
    path.write_text('{"type": "string", "maxLength": 3}')
    assert check.load_json_schema(str(path)) == {"type": "string", "maxLength": 3}
    with pytest.raises(SystemExit, match="neither inline JSON"):
        check.load_json_schema(str(tmp_path / "missing.json"))
    with pytest.raises(SystemExit, match="inline --json-schema is not JSON"):
        check.load_json_schema('{"type": ')
    path.write_text("[1, 2]")
    with pytest.raises(SystemExit, match="must be a JSON object .* got list"):
        check.load_json_schema(str(path))
    with pytest.raises(SystemExit, match="not a valid JSON schema"):
        check.SchemaChecker({"type": "objectx"})


def test_request_fields_and_checker(check, monkeypatch):
    schema = check.load_json_schema(str(check.DEFAULT_SCHEMA))
    assert check.request_fields(None) == {}
    assert check.request_fields(schema) == {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "bench", "schema": schema, "strict": True},
        }
    }
    checker = check.SchemaChecker(schema)
    assert checker.method == "jsonschema"
    assert checker.valid(json.dumps(GOOD)) and checker.valid(" \n" + json.dumps(GOOD) + "\n")
    assert not checker.valid(json.dumps({**GOOD, "role": "owner"}))  # not in the enum
    assert not checker.valid(json.dumps({**GOOD, "address": {"city": "Oslo"}}))  # nested required
    assert not checker.valid(json.dumps({**GOOD, "tags": []}))  # minItems
    assert not checker.valid(json.dumps(GOOD)[:-1])  # cut off by max_tokens
    assert not checker.valid(json.dumps(GOOD) + "{")
    monkeypatch.setitem(sys.modules, "jsonschema", None)  # not installed: json.loads only
    loose = check.SchemaChecker(schema)
    assert loose.method == "json.loads only"
    assert loose.valid(json.dumps({**GOOD, "role": "owner"})) and not loose.valid("{")


def test_a_stream_under_a_schema_keeps_text_and_actual_lengths(bench, check):
    """The body carries response_format; the text is joined from the chunks, the output length
    is the usage's (7, fewer than the 32 asked: the grammar ended) and finish_reason is kept."""
    schema = check.load_json_schema(str(check.DEFAULT_SCHEMA))
    bodies = []
    pieces = ['{"name": "Ada", "role": "admin", ', '"address": {"city": "Oslo", "zip": 150}, ',
              '"tags": ["x"]}']  # fmt: skip

    def server(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        events = [{"id": "c1", "choices": [{"text": p, "finish_reason": None}]} for p in pieces]
        events[-1]["choices"][0]["finish_reason"] = "stop"
        usage = {"prompt_tokens": 3, "completion_tokens": 7, "total_tokens": 10}
        events.append({"id": "c1", "choices": [], "usage": usage})
        body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, text=body)

    async def one(fields):
        async with httpx.AsyncClient(transport=httpx.MockTransport(server)) as client:
            return await bench.run_one(
                client, "http://x/v1/completions", "m", [11, 12, 13], 32, fields
            )

    result = asyncio.run(one(check.request_fields(schema)))
    assert bodies[0]["response_format"]["json_schema"]["schema"] == schema
    assert bodies[0]["max_tokens"] == 32 and bodies[0]["prompt"] == [11, 12, 13]
    assert result.error is None and result.output_len == 7 and result.finish_reason == "stop"
    assert json.loads(result.text) == GOOD
    plain = asyncio.run(one(None))  # without a schema: no field, no text kept
    assert "response_format" not in bodies[1] and plain.text is None

    bad = bench.RequestResult(3, 32, 0.01, 0.05, text=json.dumps(GOOD)[:-2], finish_reason="length")
    failed = bench.RequestResult(3, error="HTTP 500")
    results = [result, bad, failed]
    bench.check_outputs(results, check.SchemaChecker(schema))
    assert [r.schema_valid for r in results] == [True, False, None]
    summary = bench.summarize(results, 1.0)
    assert summary["schema_valid"] == 1 and summary["schema_checked"] == 2
    assert summary["output_tokens"] == 39 and summary["mean_output_tokens"] == 19.5
    assert summary["finish_reasons"] == {"length": 1, "stop": 1}


def test_served_run_with_a_schema_prints_schema_valid(bench, tmp_path, capsys):
    """The whole command against our server (fake engine): every request is accepted with the
    default schema, and since the fake engine writes no JSON, 0 of 6 are schema-valid; the
    --json output carries the count and the actual lengths."""
    out = tmp_path / "run.json"
    with serve_in_thread(FakeEngine(step_delay_s=0.001)) as (url, _):
        summary = bench.main(
            ["--base-url", url, "--num-prompts", "6", "--input-len", "12", "--output-len", "5",
             "--concurrency", "3", "--vocab-size", "256", "--warmup", "1",
             "--json-schema", "default", "--json", str(out)]
        )  # fmt: skip
        assert summary["completed"] == 6 and summary["failed"] == 0, summary["errors"]
        assert summary["schema_valid"] == 0 and summary["schema_checked"] == 6
        assert summary["schema_check"] == "jsonschema"
        assert summary["output_tokens"] == 30 and summary["finish_reasons"] == {"length": 6}
        printed = capsys.readouterr().out
        assert "schema-valid: 0/6 (checked with jsonschema)" in printed
        assert "output tokens: 30 generated, 5.0 per request (asked 5); finish: length 6" in printed
        saved = json.loads(out.read_text())
        assert saved["summary"]["schema_valid"] == 0 and saved["args"]["schema"]["type"] == "object"
        assert all(r["text"] and r["schema_valid"] is False for r in saved["results"])
        # without the flag: no schema line, no texts kept
        summary = bench.main(
            ["--base-url", url, "--num-prompts", "2", "--input-len", "8", "--output-len", "3",
             "--concurrency", "2", "--vocab-size", "256", "--warmup", "0"]
        )  # fmt: skip
        assert summary["schema_valid"] is None and "schema-valid" not in capsys.readouterr().out


@pytest.mark.slow
def test_real_model_outputs_are_all_schema_valid(bench, capsys):
    """The default model (SmolLM2-135M GGUF, CPU) behind our server: with the default schema
    every greedy output is JSON the schema accepts, and each ends where the grammar ends
    (``stop``), before the 200 tokens asked."""
    from fastdeploy.engine.args_utils import EngineArgs
    from fastdeploy.engine.engine import LLMEngine

    engine = LLMEngine.from_engine_args(
        EngineArgs(block_size=16, max_num_seqs=8, max_model_len=512, seed=0)
    )
    try:
        with serve_in_thread(engine, "SmolLM2-135M-Instruct") as (url, _):
            summary = bench.main(
                ["--base-url", url, "--num-prompts", "4", "--input-len", "24", "--output-len",
                 "200", "--concurrency", "4", "--vocab-size", "49152", "--warmup", "1",
                 "--json-schema", "default"]
            )  # fmt: skip
    finally:
        engine.shutdown()
    assert summary["completed"] == 4 and summary["failed"] == 0, summary["errors"]
    assert summary["schema_valid"] == 4 and summary["schema_checked"] == 4
    assert summary["finish_reasons"] == {"stop": 4}
    assert 4 * 10 < summary["output_tokens"] < 4 * 200
    assert "schema-valid: 4/4 (checked with jsonschema)" in capsys.readouterr().out
