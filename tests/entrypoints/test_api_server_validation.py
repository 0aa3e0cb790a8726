"""The HTTP layer's refusals against a fake engine: bad input gets a 400 (or 404) that names the
field, every refusal is counted by reason, and the server stays up (fast)."""

from __future__ import annotations

import httpx
import pytest
from http_server_utils import fake_server, metric_samples

MODEL = "fake-model"


@pytest.fixture(scope="module")
def server():
    with fake_server(MODEL) as running:
        yield running


BAD_INPUTS = [
    # (body or raw bytes, status, words the message must contain, param)
    (b'{"messages": [', 400, ["malformed JSON"], None),
    (
        {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
        400,
        ["temperature"],
        "temperature",
    ),
    (
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": "10"},
        400,
        ["max_tokens"],
        "max_tokens",
    ),
    (
        {"messages": [{"role": "user", "content": "x"}], "frobnicate": 1},
        400,
        ["unknown field", "frobnicate"],
        "frobnicate",
    ),
    ({"messages": [{"role": "user", "content": "x"}], "n": 0}, 400, ["n=0"], "n"),
    (
        {"messages": [{"role": "user", "content": "x"}], "presence_penalty": 2.5},
        400,
        ["presence_penalty=2.5 is invalid; allowed: a number in [-2, 2]"],
        "presence_penalty",
    ),
    (
        {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
        400,
        ["tools[0].function is missing"],
        "tools",
    ),
    ({"messages": [{"role": "user", "content": "x"}], "top_p": 0}, 400, ["top_p"], "top_p"),
    ({"messages": [{"role": "user", "content": "x" * 200}]}, 400, ["128", "max_model_len"], None),
    ({"messages": [{"role": "user", "content": "x"}], "model": "gpt-9"}, 404, ["gpt-9"], "model"),
    ({}, 400, ["messages"], "messages"),
    (
        {"messages": [{"role": "user", "content": "x"}], "stop": 5},
        400,
        ["stop: expected str or list[str]"],
        "stop",
    ),
    (
        {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        400,
        ["logprobs"],
        "top_logprobs",
    ),
    ({"messages": [{"role": "assistant", "content": "BOOM"}]}, 400, ["template"], "messages"),
]


@pytest.mark.parametrize("body,status,words,param", BAD_INPUTS)
def test_bad_chat_input(server, body, status, words, param):
    url = server[0]
    if isinstance(body, bytes):
        r = httpx.post(
            url + "/v1/chat/completions",
            content=body,
            timeout=10,
            headers={"content-type": "application/json"},
        )
    else:
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=10)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    for word in words:
        assert word in err["message"], err
    if param is not None:
        assert err["param"] == param
    assert httpx.get(url + "/health", timeout=5).status_code == 200


def test_bad_completion_input(server):
    url = server[0]
    cases = [
        ({"prompt": ["a", ""]}, "empty"),  # a batch with one bad prompt: none runs
        ({"prompt": [5, 999]}, "vocabulary"),
        ({"prompt": ""}, "empty"),
        ({"prompt": "x" * 130}, "130"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream"),
    ]
    for body, word in cases:
        r = httpx.post(url + "/v1/completions", json=body, timeout=10)
        assert r.status_code == 400 and word in r.json()["error"]["message"], r.text
    assert httpx.get(url + "/v1/models", timeout=5).status_code == 200
    r = httpx.get(url + "/v1/nope", timeout=5)
    assert r.status_code == 404 and "error" in r.json()


def test_every_refusal_is_counted_by_reason(server):
    url = server[0]
    chat = url + "/v1/chat/completions"
    msg = [{"role": "user", "content": "x"}]
    refusals = [
        (chat, {"messages": msg, "n": 129}, 400, "invalid"),
        (chat, {"messages": msg, "stop": [""]}, 400, "invalid"),
        (chat, {"messages": msg, "top_logprobs": 2}, 400, "invalid"),
        (chat, {"messages": msg, "temperature": "hot"}, 400, "invalid"),
        (chat, {"messages": msg, "model": "gpt-9"}, 404, "model_not_found"),
        (url + "/v1/completions", {"prompt": [5] * 200}, 400, "context_length"),
    ]
    for route, body, status, reason in refusals:
        before = metric_samples(url)
        r = httpx.post(route, json=body, timeout=10)
        assert r.status_code == status, r.text
        key = ("fastdeploy:request_rejected_total", (("reason", reason),))
        assert metric_samples(url)[key] - before.get(key, 0) == 1, (body, reason)


def test_error_bodies_name_param_and_code_without_pydantic_prefixes(server):
    url = server[0] + "/v1/chat/completions"
    msg = [{"role": "user", "content": "x"}]
    cases = [
        ({"messages": msg, "tools": [{"type": "function"}]}, "tools", "invalid_value"),
        ({"messages": msg, "bogus": 1}, "bogus", "unknown_parameter"),
        ({"messages": msg, "max_tokens": "10"}, "max_tokens", "invalid_type"),
        ({}, "messages", "missing_required_parameter"),
        ({"messages": msg, "min_tokens": 20, "max_tokens": 5}, "min_tokens", "invalid_value"),
        ({"messages": [{"role": "user", "content": "x" * 200}]}, "messages", None),
    ]
    for body, param, code in cases:
        r = httpx.post(url, json=body, timeout=10)
        err = r.json()["error"]
        assert r.status_code == 400, r.text
        assert "Value error" not in err["message"] and "Assertion failed" not in err["message"]
        assert err["param"] == param, err
        assert err["code"] == (code or "context_length_exceeded"), err
    r = httpx.post(url, json={"messages": msg, "tools": [{"type": "function"}]}, timeout=10)
    assert r.json()["error"]["message"] == (
        'tools[0].function is missing; allowed: {"type": "function", "function": {"name": ..., '
        '"parameters": {...}}}'
    )


@pytest.mark.parametrize(
    "fields, param, words",
    [
        ({"frequency_penalty": -2.5}, "frequency_penalty", "a number in [-2, 2]"),
        ({"repetition_penalty": 0}, "repetition_penalty", "a finite number > 0"),
        ({"logit_bias": {"abc": 1}}, "logit_bias", "token ids as strings"),
        ({"logit_bias": {"5": 101}}, "logit_bias", "bias values in [-100, 100]"),
        ({"logit_bias": {"300": 1}}, "logit_bias", "token ids in [0, 256)"),
        ({"stop_token_ids": [256]}, "stop_token_ids", "token ids in [0, 256)"),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias", "at most 300"),
    ],
)
def test_out_of_range_sampling_fields_are_a_400(server, fields, param, words):
    body = {"messages": [{"role": "user", "content": "x"}], **fields}
    r = httpx.post(server[0] + "/v1/chat/completions", json=body, timeout=10)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and words in err["message"], err


def test_validation_message_merges_union_branches_only():
    from fastdeploy.entrypoints.openai.errors import validation_message

    union = [
        {"type": "string_type", "loc": ("body", "stop", "str"), "msg": "m", "input": 5},
        {"type": "list_type", "loc": ("body", "stop", "list[str]"), "msg": "m", "input": 5},
    ]
    assert validation_message(union) == ("stop: expected str or list[str] (got 5)", "stop")
    parent = {"x": 1}
    siblings = [
        {"type": "missing", "loc": ("body", "messages", 0, "role"), "msg": "m", "input": parent},
        {"type": "missing", "loc": ("body", "messages", 0, "name"), "msg": "m", "input": parent},
    ]
    message, param = validation_message(siblings)
    assert "'messages.0.role'" in message and "'messages.0.name'" in message
    assert param == "messages.0.role"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (
            "/v1/completions",
            '{"model": "fake-model", "prompt": "a\\ud83d", "max_tokens": 2}',
            "prompt",
        ),
        (
            "/v1/chat/completions",
            '{"model": "fake-model", "messages": [{"role": "user", "content": "\\ud83d"}]}',
            "messages",
        ),
    ],
)
def test_lone_surrogate_is_a_400_and_the_server_stays_up(server, path, body, param):
    """JSON allows an unpaired UTF-16 surrogate escape; no tokenizer can encode it."""
    url = server[0]
    r = httpx.post(url + path, content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and "unpaired UTF-16 surrogate" in error["message"]
    ok = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200


def test_seed_beyond_64_bits_is_a_400_not_a_dead_engine(server):
    url = server[0]
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "seed": 2**64}
    r = httpx.post(url + "/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text
    body["seed"] = 2**64 - 1
    assert httpx.post(url + "/v1/completions", json=body).status_code == 200
    assert httpx.get(url + "/health").status_code == 200
