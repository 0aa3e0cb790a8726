"""Refusals found by a break-it pass, against the fake engine (``max_model_len`` 128, vocabulary
0..255): ``max_tokens`` past the context, bad prompts on the prompt's field, NaN and infinite
sampling values, and request fields that are not supported. Each is a 400 that names the field and
the value, is counted, and leaves nothing queued in the engine (fast)."""

from __future__ import annotations

import json
import math

import httpx
import pytest
from fake_llm_engine import FakeTokenizer
from http_server_utils import fake_server, get_json, metric_samples

from fastdeploy.core.request import InvalidPromptError
from fastdeploy.core.sampling_params import SamplingParams
from fastdeploy.entrypoints.openai.errors import api_error_from

MODEL = "fake-model"
MAX_MODEL_LEN = 128
MSG = [{"role": "user", "content": "x"}]
CHAT_PROMPT_LEN = len(FakeTokenizer().encode(FakeTokenizer().apply_chat_template(MSG)))


@pytest.fixture(scope="module")
def server():
    with fake_server(MODEL) as running:
        yield running


def post(url: str, path: str, body: dict | str) -> httpx.Response:
    if isinstance(body, str):  # raw JSON, for NaN and Infinity
        headers = {"content-type": "application/json"}
        return httpx.post(url + path, content=body, headers=headers, timeout=10)
    return httpx.post(url + path, json=body, timeout=10)


def error_of(r: httpx.Response) -> dict:
    assert r.status_code == 400, r.text
    return r.json()["error"]


def assert_idle(server) -> None:
    """Nothing queued or running: a refused request never reached the engine."""
    url, engine, _ = server
    assert not engine.requests
    assert get_json(url, "/v1/server_info")["num_in_flight"] == 0


# ------------------------------------------------------------------ max_tokens past the context
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "path, body, prompt_len, where",
    [
        ("/v1/chat/completions", {"messages": MSG}, CHAT_PROMPT_LEN, "in the messages"),
        ("/v1/completions", {"prompt": "x"}, 1, "in the prompt"),
        ("/v1/completions", {"prompt": [5, 6, 7]}, 3, "in the prompt"),
    ],
)
def test_max_tokens_beyond_the_context_is_a_400_naming_the_numbers(
    server, path, body, prompt_len, where, stream
):
    url = server[0]
    before = metric_samples(url)
    r = post(url, path, {**body, "max_tokens": 1_000_000_000, "stream": stream})
    err = error_of(r)
    assert (err["param"], err["code"]) == ("max_tokens", "context_length_exceeded")
    assert err["type"] == "invalid_request_error"
    assert err["message"] == (
        f"this model's maximum context length is {MAX_MODEL_LEN} tokens, but the request asks "
        f"for {1_000_000_000 + prompt_len}: {prompt_len} {where} plus max_tokens=1000000000; "
        f"allowed: max_tokens <= {MAX_MODEL_LEN - prompt_len} for this prompt, or leave "
        "max_tokens out to generate up to the context length"
    )
    key = ("fastdeploy:request_rejected_total", (("reason", "context_length"),))
    assert metric_samples(url)[key] - before.get(key, 0) == 1
    assert_idle(server)


def test_max_completion_tokens_is_the_field_named(server):
    body = {"messages": MSG, "max_completion_tokens": MAX_MODEL_LEN}
    err = error_of(post(server[0], "/v1/chat/completions", body))
    assert err["param"] == "max_completion_tokens"
    assert f"max_completion_tokens <= {MAX_MODEL_LEN - CHAT_PROMPT_LEN}" in err["message"]


def test_max_tokens_that_exactly_fills_the_context_is_served(server):
    url = server[0]
    room = MAX_MODEL_LEN - CHAT_PROMPT_LEN
    r = post(url, "/v1/chat/completions", {"messages": MSG, "max_tokens": room})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == room
    err = error_of(post(url, "/v1/chat/completions", {"messages": MSG, "max_tokens": room + 1}))
    assert err["param"] == "max_tokens"


def test_max_tokens_left_out_still_generates_up_to_the_context(server):
    """Left out, max_tokens refuses nothing: chat runs to max_model_len, and a completion's
    default of 16 is a cap even when the prompt leaves less room than that."""
    url = server[0]
    r = post(url, "/v1/chat/completions", {"messages": MSG})
    assert r.status_code == 200, r.text
    choice, usage = r.json()["choices"][0], r.json()["usage"]
    assert choice["finish_reason"] == "length"
    assert usage["total_tokens"] == MAX_MODEL_LEN
    r = post(url, "/v1/completions", {"prompt": [5] * 120})  # 8 tokens of room, default 16
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 8
    assert r.json()["choices"][0]["finish_reason"] == "length"
    r = post(url, "/v1/completions", {"prompt": [5] * 120, "max_tokens": None})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8


def test_a_prompt_with_no_room_is_still_a_prompt_error(server):
    """Both the prompt and max_tokens are too long: the prompt's own rule answers."""
    err = error_of(post(server[0], "/v1/completions", {"prompt": [5] * 130, "max_tokens": 50}))
    assert (err["param"], err["code"]) == ("prompt", "context_length_exceeded")
    assert "the prompt has 130 tokens, but max_model_len is 128" in err["message"]


# ------------------------------------------------------------------ bad prompts name their field
@pytest.mark.parametrize(
    "prompt, words",
    [
        ("", "the prompt is empty (0 tokens); allowed: at least 1 token"),
        ([], "the prompt is empty (0 tokens); allowed: at least 1 token"),
        ([[]], "the prompt is empty (0 tokens); allowed: at least 1 token"),
        (
            [5, 999],
            "prompt token id 999 at position 1 is outside the vocabulary; allowed: token ids "
            "in 0..255",
        ),
        ([-1], "prompt token id -1 at position 0 is outside the vocabulary"),
    ],
)
def test_bad_prompts_are_a_400_on_prompt(server, prompt, words):
    err = error_of(post(server[0], "/v1/completions", {"prompt": prompt, "max_tokens": 2}))
    assert (err["param"], err["code"]) == ("prompt", "invalid_value")
    assert words in err["message"], err
    assert_idle(server)


def test_a_bad_chat_prompt_is_a_400_on_messages():
    """A chat prompt comes from the template; its errors name ``messages``."""
    error = api_error_from(InvalidPromptError("prompt token id 300 ..."), "messages")
    assert (error.status, error.param, error.code) == (400, "messages", "invalid_value")


# ------------------------------------------------------------------ NaN and infinite values
RANGES = {
    "temperature": "a number in [0, 2]",
    "top_p": "a number in (0, 1]",
    "presence_penalty": "a number in [-2, 2]",
    "frequency_penalty": "a number in [-2, 2]",
    "repetition_penalty": "a finite number > 0",
}


@pytest.mark.parametrize(
    "literal, shown", [("NaN", "nan"), ("Infinity", "inf"), ("-Infinity", "-inf")]
)
@pytest.mark.parametrize("field", list(RANGES))
def test_nan_and_infinite_sampling_values_name_the_value_and_range(server, field, literal, shown):
    body = '{"messages": [{"role": "user", "content": "x"}], "' + field + '": ' + literal + "}"
    err = error_of(post(server[0], "/v1/chat/completions", body))
    assert (err["param"], err["code"]) == (field, "invalid_value")
    assert err["message"].startswith(f"{field}={shown} is invalid; allowed: {RANGES[field]}"), err
    assert_idle(server)


def test_offline_sampling_params_refuse_an_infinite_temperature():
    for value in (math.inf, math.nan):
        with pytest.raises(
            ValueError, match=r"temperature=(inf|nan) is invalid; allowed: a finite"
        ):
            SamplingParams(temperature=value)


# ------------------------------------------------------------------ fields that are not supported
@pytest.mark.parametrize(
    "path, fields, param, message",
    [
        ("/v1/completions", {"n": 129}, "n", "n=129 is invalid; allowed: an integer in "
         "[1, 128]"),
        ("/v1/chat/completions", {"n": 0}, "n", "n=0 is invalid; allowed: an integer in "
         "[1, 128]"),
        ("/v1/completions", {"best_of": 2}, "best_of", "best_of=2 is not supported with n=1; "
         "allowed: null or 1 (the request's n)"),
        ("/v1/completions", {"n": 2, "best_of": 3}, "best_of", "best_of=3 is not supported "
         "with n=2; allowed: null or 2 (the request's n)"),
        ("/v1/completions", {"echo": True, "stream": True}, "echo", "echo=true is not supported "
         "with stream=true; allowed: echo=false, or stream=false"),
        ("/v1/completions", {"suffix": "!"}, "suffix", 'suffix="!" is not supported; allowed: '
         "null"),
        ("/v1/chat/completions", {"echo": True}, "echo", "unknown field 'echo'"),
        ("/v1/chat/completions", {"best_of": 2}, "best_of", "unknown field 'best_of'"),
    ],
)  # fmt: skip
def test_unsupported_fields_are_refused_not_ignored(server, path, fields, param, message):
    body = {"messages": MSG} if path.endswith("chat/completions") else {"prompt": "x"}
    err = error_of(post(server[0], path, {**body, "max_tokens": 2, **fields}))
    assert err["param"] == param and err["message"] == message, err
    assert_idle(server)


def test_the_neutral_values_of_unsupported_fields_are_served(server):
    body = {"prompt": "x", "max_tokens": 2, "n": 1, "best_of": 1, "echo": False, "suffix": None}
    r = post(server[0], "/v1/completions", body)
    assert r.status_code == 200 and json.loads(r.text)["usage"]["completion_tokens"] == 2


# ------------------------------------------------------------------ tokenizing
@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "y" * (2 * MAX_MODEL_LEN + 1)}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "y" * 300}]},
         "messages"),
    ],
)  # fmt: skip
def test_a_text_too_long_for_any_context_is_refused_before_it_is_tokenized(
    server, monkeypatch, path, body, param
):
    """A break-it pass sent an 18 MB prompt: tokenizing it took 9 s, and /health waited as long.
    The fake's tokens are one character each, so any text of more than 2 * 128 characters
    cannot fit; it is refused by its length, and the tokenizer never sees it."""
    url, engine, _ = server
    seen = []
    monkeypatch.setattr(FakeTokenizer, "encode", lambda self, text, **kw: seen.append(text))
    error = error_of(post(url, path, {"model": MODEL, **body}))
    assert error["param"] == param and error["code"] == "context_length_exceeded"
    assert (
        "more than any text that fits" in error["message"] and "256 characters" in error["message"]
    )
    assert seen == []
    assert_idle(server)


def test_tokenizing_runs_off_the_event_loop(server, monkeypatch):
    """While one request's prompt is being tokenized, the server answers others: the encode
    below blocks until /health has been answered, which could never happen if it ran on the
    event loop (the test would then time out instead of passing)."""
    import threading

    url, engine, _ = server
    answered, entered = threading.Event(), threading.Event()
    encode = FakeTokenizer.encode

    def slow_encode(self, text, **kwargs):
        entered.set()
        assert answered.wait(10), "the health check was not answered while tokenizing"
        return encode(self, text, **kwargs)

    monkeypatch.setattr(FakeTokenizer, "encode", slow_encode)
    result = {}
    worker = threading.Thread(
        target=lambda: result.setdefault(
            "r", post(url, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2})
        )
    )
    worker.start()
    try:
        assert entered.wait(10)
        assert httpx.get(url + "/health", timeout=5).status_code == 200
    finally:
        answered.set()
        worker.join(20)
    assert result["r"].status_code == 200, result["r"].text


JSON_UTF8 = {"content-type": "application/json; charset=utf-8"}


def test_a_body_sent_as_a_form_is_told_to_use_json(server):
    """``curl -d`` sends ``application/x-www-form-urlencoded``: the refusal names the header,
    not the (valid JSON) body; JSON with a charset parameter is still read."""
    url, _, _ = server
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2})
    r = httpx.post(
        url + "/v1/completions",
        content=body,
        headers={"content-type": "application/x-www-form-urlencoded"},
        timeout=10,
    )
    error = error_of(r)
    assert "Content-Type 'application/x-www-form-urlencoded' is not supported" in error["message"]
    assert "application/json" in error["message"]
    ok = httpx.post(url + "/v1/completions", content=body, headers=JSON_UTF8, timeout=10)
    assert ok.status_code == 200, ok.text
    assert_idle(server)


@pytest.mark.parametrize(
    "prompt, text",
    [
        ([1, 2.5], "prompt[1] is float 2.5, but prompt[0] is a token id (an integer)"),
        ([1, True], "prompt[1] is bool True, but prompt[0] is a token id (an integer)"),
        (["a", [1]], "prompt[1] is a list of token ids, but prompt[0] is a string"),
        ([2.5], "prompt[0] is float 2.5; allowed: a string, a list of token ids"),
    ],
)
def test_a_list_prompt_mixing_kinds_names_the_first_odd_item(server, prompt, text):
    """pydantic answered each branch of the prompt's union at once (``prompt.str: ...;
    prompt.list[str].0: ...; ...``); one message now names the item that differs."""
    url, _, _ = server
    error = error_of(post(url, "/v1/completions", {"model": MODEL, "prompt": prompt}))
    assert error["param"] == "prompt" and text in error["message"], error
    assert ";" not in error["message"].split("; allowed")[0]
    assert_idle(server)


# ------------------------------------------------------------------ caps on stop conditions
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "path, body",
    [("/v1/completions", {"prompt": [5, 6]}), ("/v1/chat/completions", {"messages": MSG})],
    ids=["completions", "chat"],
)
@pytest.mark.parametrize(
    "fields, param, message",
    [
        (
            {"stop": [f"s{i}" for i in range(10_000)]},
            "stop",
            "stop has 10000 stop strings, more than the cap of 64 (--max-stop-strings); "
            "allowed: at most 64 stop strings",
        ),
        (
            {"stop": "x" * 5000},
            "stop",
            "stop has 5000 characters in all stop strings, more than the cap of 4096 "
            "(--max-stop-chars); allowed: at most 4096 characters in all stop strings",
        ),
        (
            {"stop_token_ids": list(range(300))},
            "stop_token_ids",
            "stop_token_ids has 300 stop_token_ids, more than the cap of 256 "
            "(--max-stop-token-ids); allowed: at most 256 stop_token_ids",
        ),
    ],
    ids=["10000_strings", "5000_chars", "300_token_ids"],
)
def test_stop_conditions_over_their_caps_are_a_400_naming_cap_and_value(
    server, path, body, fields, param, message, stream
):
    """Issue 43: 10,000 stop strings were accepted and made every step of their request 7x
    slower. Now the request is refused before it is tokenized, counted as ``stop_limit``."""
    url = server[0]
    before = metric_samples(url)
    err = error_of(post(url, path, {**body, **fields, "max_tokens": 2, "stream": stream}))
    assert (err["param"], err["code"], err["message"]) == (param, "invalid_value", message)
    key = ("fastdeploy:request_rejected_total", (("reason", "stop_limit"),))
    assert metric_samples(url)[key] - before.get(key, 0) == 1
    assert_idle(server)


def test_stop_conditions_at_their_caps_are_served(server):
    body = {"prompt": [5, 6], "max_tokens": 2, "stop": [f"s{i:02d}" for i in range(64)]}
    body["stop_token_ids"] = list(range(256))  # the fake vocabulary: 0..255
    r = post(server[0], "/v1/completions", body)
    assert r.status_code == 200, r.text
    r = post(server[0], "/v1/completions", {"prompt": [5], "max_tokens": 2, "stop": "x" * 4096})
    assert r.status_code == 200, r.text


def test_offline_sampling_params_cap_stop_conditions_at_the_ceilings():
    """The offline API has no server flags: it refuses what no flag may allow."""
    SamplingParams(stop=["s"] * 1024, stop_token_ids=[1] * 4096)
    with pytest.raises(ValueError) as err:
        SamplingParams(stop=["s"] * 1025)
    assert str(err.value) == (
        "stop has 1025 stop strings, more than the cap of 1024; allowed: at most 1024 stop strings"
    )
    with pytest.raises(ValueError, match="stop has 65537 characters in all stop strings"):
        SamplingParams(stop=["x" * 65537])
    with pytest.raises(ValueError, match="stop_token_ids has 4097 stop_token_ids"):
        SamplingParams(stop_token_ids=[1] * 4097)
