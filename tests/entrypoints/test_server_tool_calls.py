"""Tool calling through the ``openai`` client against the server with the default model
(SmolLM2-135M-Instruct GGUF, CPU), started with ``--enable-auto-tool-choice --tool-call-parser
hermes``: ``auto`` (a greedy call after a one-shot history, and plain text that stays content),
``required`` and a named function (constrained: the arguments always match the schema), each
streamed and not; a two-turn exchange whose second turn renders the ``tool`` result (shown by
``/tokenize`` and the prompt token count); ``n=2`` parsing each choice; 400s on the wire."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from http_server_utils import serve_in_thread

from fastdeploy.engine.args_utils import EngineArgs
from fastdeploy.entrypoints.openai.tool_config import ToolServingConfig

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
}
ZONE = {
    "type": "object",
    "properties": {"tz": {"enum": ["UTC", "CET", "JST"]}},
    "required": ["tz"],
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": CITY,
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "description": "The time in a zone", "parameters": ZONE},
}
SCHEMAS = {"get_weather": CITY, "get_time": ZONE}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
#: One earlier call in the history: greedy decoding then calls again (found by trying prompts;
#: without it the 135M model answers in prose).
ONE_SHOT = [
    {"role": "user", "content": "What is the weather in London?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_0",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "London"}'},
            }
        ],
    },
    {"role": "user", "content": "What is the weather in Paris?"},
]


@pytest.fixture(scope="module")
def server():
    """(sync client, base url, engine)."""
    from fastdeploy.engine.engine import LLMEngine

    args = EngineArgs(block_size=16, max_num_seqs=8, max_model_len=1024, seed=0)
    engine = LLMEngine.from_engine_args(args)
    config = ToolServingConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")
    try:
        with serve_in_thread(engine, MODEL, tool_config=config) as (url, _):
            client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
            yield client, url, engine
    finally:
        engine.shutdown()


def chat(client, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("messages", ASK)
    kw.setdefault("tools", [WEATHER, TIME])
    return client.chat.completions.create(model=MODEL, max_tokens=80, **kw)


def streamed(client, **kw) -> dict[int, dict]:
    """Per choice index: content, finish reason, and the calls rebuilt from their deltas
    (checking OpenAI's delta rules on the way)."""
    out: dict[int, dict] = {}
    for chunk in chat(client, stream=True, **kw):
        for c in chunk.choices:
            got = out.setdefault(c.index, {"content": "", "reason": None, "calls": {}})
            got["content"] += c.delta.content or ""
            got["reason"] = c.finish_reason or got["reason"]
            indices = [d.index for d in c.delta.tool_calls or []]
            assert len(indices) == len(set(indices)), c  # one entry per call in a chunk
            for d in c.delta.tool_calls or []:
                if d.index not in got["calls"]:  # the first delta of a call
                    assert d.id.startswith("chatcmpl-tool-") and d.type == "function", d
                    assert d.function.name and d.function.arguments == "", d
                    got["calls"][d.index] = {"name": d.function.name, "arguments": ""}
                else:
                    assert d.id is None and d.function.name is None, d
                    got["calls"][d.index]["arguments"] += d.function.arguments
    return out


def check_calls(calls: list[tuple[str, str]], names: set[str]) -> None:
    assert calls
    for name, arguments in calls:
        assert name in names
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_auto_greedy_call_streamed_and_not(server):
    client, _, _ = server
    choice = chat(client, messages=ONE_SHOT).choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}

    got = streamed(client, messages=ONE_SHOT)[0]
    assert got["reason"] == "tool_calls" and got["content"] == ""
    assert list(got["calls"]) == [0]
    assert got["calls"][0]["name"] == "get_weather"
    assert json.loads(got["calls"][0]["arguments"]) == {"city": "Paris"}


def test_auto_plain_text_stays_content(server):
    client, _, _ = server
    ask = [{"role": "user", "content": "What is 2+2?"}]
    choice = chat(client, messages=ask).choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason == "stop"
    assert "4" in choice.message.content
    got = streamed(client, messages=ask)[0]
    assert got == {"content": choice.message.content, "reason": "stop", "calls": {}}


def test_required_streamed_and_not(server):
    client, _, _ = server
    choice = chat(client, tool_choice="required").choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    check_calls(calls, {"get_weather", "get_time"})
    got = streamed(client, tool_choice="required")[0]
    assert got["reason"] == "tool_calls"
    streamed_calls = [(c["name"], c["arguments"]) for c in got["calls"].values()]
    check_calls(streamed_calls, {"get_weather", "get_time"})
    assert [json.loads(a) for _, a in streamed_calls] == [json.loads(a) for _, a in calls]


def test_named_function_streamed_and_not(server):
    client, _, _ = server
    named = {"type": "function", "function": {"name": "get_time"}}
    for seed in range(3):  # sampled: the grammar holds whatever is drawn
        choice = chat(client, tool_choice=named, temperature=1.0, seed=seed).choices[0]
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        check_calls([(call.function.name, call.function.arguments)], {"get_time"})
    got = streamed(client, tool_choice=named)[0]
    assert got["reason"] == "tool_calls" and len(got["calls"]) == 1
    check_calls([(got["calls"][0]["name"], got["calls"][0]["arguments"])], {"get_time"})


def test_two_turns_with_a_tool_result(server):
    client, url, _ = server
    first = chat(client, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"},
    ]
    tokens = httpx.post(
        url + "/tokenize", json={"messages": history, "tools": [WEATHER, TIME]}, timeout=30
    ).json()
    text = httpx.post(url + "/detokenize", json={"tokens": tokens["tokens"]}, timeout=30).json()
    rendered = text["prompt"]
    assert "<tool_response>\n18 degrees and sunny\n</tool_response>" in rendered
    assert f'<tool_call>\n{{"name": "get_weather", "arguments": {call.function.arguments}}}' in (
        rendered
    )
    assert rendered.endswith("<|im_start|>assistant\n")
    second = chat(client, messages=history, tool_choice="none")
    assert second.usage.prompt_tokens == tokens["count"]
    answer = second.choices[0]
    assert answer.finish_reason in ("stop", "length") and answer.message.tool_calls is None
    assert answer.message.content.strip()
    auto = chat(client, messages=history)  # auto: the answer arrives as content or a call
    assert auto.usage.prompt_tokens == tokens["count"]
    assert auto.choices[0].message.content or auto.choices[0].message.tool_calls


def test_n_choices_parse_each(server):
    client, _, _ = server
    out = chat(client, tool_choice="required", n=3, temperature=1.0, seed=7)
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls"
        check_calls(
            [(c.function.name, c.function.arguments) for c in choice.message.tool_calls],
            {"get_weather", "get_time"},
        )
    got = streamed(client, tool_choice="required", n=2, temperature=1.0, seed=7)
    assert sorted(got) == [0, 1]
    for g in got.values():
        assert g["reason"] == "tool_calls"
        check_calls([(c["name"], c["arguments"]) for c in g["calls"].values()], SCHEMAS.keys())


@pytest.mark.parametrize(
    "body, param, words",
    [
        (
            {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "nope",
        ),
        ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
            "tools",
            "tools[0].function.parameters",
        ),
        (
            {"messages": [*ASK, {"role": "tool", "content": "x"}]},
            "messages",
            "tool_call_id is required",
        ),
    ],
)
def test_bad_tool_requests_are_400(server, body, param, words):
    _, url, engine = server
    payload = {"messages": ASK, "tools": [WEATHER], **body}
    if payload["tools"] is None:
        del payload["tools"]
    r = httpx.post(url + "/v1/chat/completions", json=payload, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
