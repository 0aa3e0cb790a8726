"""Structured outputs through the ``openai`` client against the server with the default model
(SmolLM2-135M-Instruct GGUF, CPU): a JSON schema with nested objects, enums and arrays (greedy,
streamed and not, and 50 seeded samples, every one valid under ``jsonschema``), JSON mode, a
regex, a choice and an EBNF grammar on both endpoints; a grammar that ends finishes with
``stop``; a bad schema is a 400 naming the problem and leaves no KV block behind."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest
from http_server_utils import serve_in_thread

from fastdeploy.engine.args_utils import EngineArgs

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "zip": {"type": "integer", "minimum": 0, "maximum": 99999},
            },
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "role", "tags", "address"],
}
ASK = [{"role": "user", "content": "Describe a user of a website as JSON."}]
SCHEMA_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "person", "schema": PERSON, "strict": True},
}


@pytest.fixture(scope="module")
def server():
    """(sync client, async client factory, engine)."""
    from fastdeploy.engine.engine import LLMEngine

    args = EngineArgs(block_size=16, max_num_seqs=8, max_model_len=512, seed=0)
    engine = LLMEngine.from_engine_args(args)
    try:
        with serve_in_thread(engine, MODEL) as (url, _):
            client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
            yield client, lambda: openai.AsyncOpenAI(base_url=url + "/v1", api_key="x"), engine
    finally:
        engine.shutdown()


def chat(client, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("messages", ASK)
    return client.chat.completions.create(model=MODEL, max_tokens=200, **kw)


def stream_text(client, **kw) -> tuple[str, str]:
    text, reason = "", None
    for chunk in chat(client, stream=True, **kw):
        for c in chunk.choices:
            text += c.delta.content or ""
            reason = c.finish_reason or reason
    return text, reason


def test_greedy_json_schema_streamed_and_not(server):
    client, _, engine = server
    masked = engine.grammars.num_masked_steps
    out = chat(client, response_format=SCHEMA_FORMAT).choices[0]
    assert out.finish_reason == "stop"
    jsonschema.validate(json.loads(out.message.content), PERSON)
    text, reason = stream_text(client, response_format=SCHEMA_FORMAT)
    assert (text, reason) == (out.message.content, "stop")
    assert engine.grammars.num_masked_steps - masked >= 2 * 10  # every decode step was masked


def test_fifty_seeded_samples_all_match_the_schema(server):
    _, async_client, engine = server

    async def run() -> list:
        async with async_client() as client:
            return await asyncio.gather(*calls(client))

    def calls(client) -> list:
        return [
            client.chat.completions.create(
                model=MODEL, messages=ASK, max_tokens=200, temperature=1.0, seed=seed,
                extra_body={"guided_json": PERSON},
            )
            for seed in range(50)
        ]  # fmt: skip

    outs = [r.choices[0] for r in asyncio.run(run())]
    docs = [json.loads(o.message.content) for o in outs]
    for doc in docs:
        jsonschema.validate(doc, PERSON)
    assert all(o.finish_reason == "stop" for o in outs)
    assert len({json.dumps(d) for d in docs}) > 10  # sampled, not 50 copies of one answer
    engine.check_integrity()


def test_json_mode_answers_an_object(server):
    client, _, _ = server
    q = 'What is the capital of France? Answer in JSON with the key "capital".'
    ask = [{"role": "user", "content": q}]
    fmt = {"type": "json_object"}
    text, reason = stream_text(client, response_format=fmt, messages=ask)
    assert json.loads(text) == {"capital": "Paris"} and reason == "stop"
    out = chat(client, response_format=fmt, messages=ask).choices[0]
    assert (out.message.content, out.finish_reason) == (text, "stop")


def test_regex_choice_and_grammar_on_both_endpoints(server):
    client, _, _ = server
    pattern = r"[0-9]{3}-[a-z]{2,4}"
    out = chat(client, extra_body={"guided_regex": pattern}).choices[0]
    assert re.fullmatch(pattern, out.message.content) and out.finish_reason == "stop"
    out = chat(client, extra_body={"structured_outputs": {"choice": ["yes", "no"]}}).choices[0]
    assert out.message.content in ("yes", "no") and out.finish_reason == "stop"
    done = client.completions.create(
        model=MODEL, prompt="Is the sky blue? Answer:", max_tokens=50, temperature=0,
        extra_body={"guided_grammar": 'root ::= " " ("yes" | "no") "."'},
    )  # fmt: skip
    assert done.choices[0].text in (" yes.", " no.")
    # The grammar's end stops the request (not max_tokens), with eos as its last token.
    assert done.choices[0].finish_reason == "stop" and done.usage.completion_tokens < 50
    text = ""
    for chunk in client.completions.create(
        model=MODEL, prompt="Pick a number:", max_tokens=50, temperature=0, stream=True,
        extra_body={"guided_regex": pattern},
    ):  # fmt: skip
        text += chunk.choices[0].text if chunk.choices else ""
    assert re.fullmatch(pattern, text)


def test_bad_schema_is_a_400_naming_the_problem(server):
    client, _, engine = server
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, response_format=bad)
    assert 'Unsupported type "objectx"' in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model=MODEL, prompt="x", extra_body={"guided_regex": "a(b"}, max_tokens=5
        )
    assert "regex is invalid" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, response_format={"type": "json_object"}, extra_body={"guided_regex": "a"})
    assert "both constrain the output" in e.value.message
    engine.check_integrity()
