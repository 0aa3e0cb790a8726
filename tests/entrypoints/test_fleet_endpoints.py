"""vLLM's fleet routes against the fake engine (fast): ``/version``, ``/ping``, ``/tokenize``
(text and chat forms), ``/detokenize``, ``/v1/models/{model_id}``; hostile bodies, the request
limits and ``--api-key``. The real-model check (``/tokenize`` of a chat equals the chat endpoint's
``usage.prompt_tokens``; ``/detokenize`` round-trips) is in ``test_api_server_e2e.py``."""

from __future__ import annotations

import json

import httpx
import pytest
from fake_llm_engine import FakeEngine, FakeTokenizer
from http_server_utils import fake_server, get_json, metric_samples, serve_in_thread

import fastdeploy
from fastdeploy.entrypoints.openai.limits import HTTPLimits

MODEL = "fake-model"
TOK = FakeTokenizer()
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server():
    with fake_server(MODEL) as running:
        yield running


def post(url: str, path: str, body, headers: dict | None = None) -> httpx.Response:
    """POST ``body`` as ASCII JSON (so a lone surrogate travels as ``\\ud83d``)."""
    headers = {"content-type": "application/json", **(headers or {})}
    return httpx.post(url + path, content=json.dumps(body), headers=headers, timeout=10)


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


def test_version_is_the_package_version(server):
    assert get_json(server[0], "/version") == {"version": fastdeploy.__version__}


def test_ping_answers_what_health_answers_for_get_and_post(server):
    url = server[0]
    health = httpx.get(url + "/health", timeout=5)
    for method in ("GET", "POST"):
        r = httpx.request(method, url + "/ping", timeout=5)
        assert (
            (r.status_code, r.json())
            == (health.status_code, health.json())
            == (200, {"status": "ok"})
        )


def test_ping_is_503_with_health_when_the_engine_loop_stopped():
    engine = FakeEngine()
    with serve_in_thread(engine, MODEL) as (url, _):
        engine.fail_next_step = True
        r = post(url, "/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert r.status_code == 503
        health = httpx.get(url + "/health", timeout=5)
        assert (health.status_code, health.json()) == (503, {"status": "unavailable"})
        for method in ("GET", "POST"):
            r = httpx.request(method, url + "/ping", timeout=5)
            assert (r.status_code, r.json()) == (503, {"status": "unavailable"})
        # The tokenizer routes need no engine loop (as vLLM's).
        assert post(url, "/tokenize", {"prompt": "ab"}).json()["tokens"] == [97, 98]


def test_tokenize_text(server):
    url = server[0]
    r = post(url, "/tokenize", {"model": MODEL, "prompt": "hi!"})
    assert r.status_code == 200, r.text
    assert r.json() == {
        "count": 3,
        "max_model_len": 128,
        "tokens": [104, 105, 33],
        "token_strs": None,
    }
    r = post(
        url, "/tokenize", {"prompt": "ab", "return_token_strs": True, "add_special_tokens": False}
    )
    assert r.json() == {
        "count": 2,
        "max_model_len": 128,
        "tokens": [97, 98],
        "token_strs": ["a", "b"],
    }


def test_tokenize_chat_counts_what_the_chat_endpoint_counts(server):
    url = server[0]
    r = post(url, "/tokenize", {"model": MODEL, "messages": HI})
    assert r.status_code == 200, r.text
    want = TOK.encode("user: hi\nassistant:")
    assert r.json()["tokens"] == want and r.json()["count"] == len(want)
    chat = post(url, "/v1/chat/completions", {"messages": HI, "max_tokens": 2})
    assert chat.json()["usage"]["prompt_tokens"] == r.json()["count"]
    # add_generation_prompt=false, developer as system, text parts joined, template variables.
    body = {
        "messages": [
            {
                "role": "developer",
                "content": [{"type": "text", "text": "be"}, {"type": "text", "text": " brief"}],
            },
            {"role": "user", "content": "x"},
        ],
        "add_generation_prompt": False,
        "chat_template_kwargs": {"greeting": "hello"},
        "return_token_strs": True,
    }
    r = post(url, "/tokenize", body)
    text = "hello\nsystem: be brief\nuser: x\n"
    assert r.json()["tokens"] == TOK.encode(text) and r.json()["token_strs"] == list(text)


def test_detokenize_and_round_trip(server):
    url = server[0]
    r = post(url, "/detokenize", {"model": MODEL, "tokens": [104, 105]})
    assert r.status_code == 200 and r.json() == {"prompt": "hi"}
    assert post(url, "/detokenize", {"tokens": []}).json() == {"prompt": ""}
    text = "round trip: ~{}"
    ids = post(url, "/tokenize", {"prompt": text}).json()["tokens"]
    assert post(url, "/detokenize", {"tokens": ids}).json() == {"prompt": text}


@pytest.mark.parametrize("tokens, bad", [([104, 256], "tokens[1]=256"), ([-1], "tokens[0]=-1")])
def test_detokenize_outside_the_vocabulary_is_a_400_naming_the_id_and_range(server, tokens, bad):
    err = error_of(post(server[0], "/detokenize", {"tokens": tokens}), 400)
    assert err["message"] == f"{bad} is outside the vocabulary; allowed: token ids in 0..255"
    assert err["param"] == "tokens"


def test_model_card_by_id_equals_the_listed_one(server):
    url = server[0]
    listed = get_json(url, "/v1/models")["data"][0]
    card = get_json(url, f"/v1/models/{MODEL}")
    assert {**card, "created": 0} == {**listed, "created": 0}
    assert card["id"] == MODEL and card["max_model_len"] == 128 and card["object"] == "model"


def test_a_served_name_with_a_slash_is_found_by_id():
    with fake_server("org/model-x") as (url, _, _):
        assert get_json(url, "/v1/models/org/model-x")["id"] == "org/model-x"
        err = error_of(httpx.get(url + "/v1/models/org", timeout=5), 404)
        assert err["code"] == "model_not_found"


@pytest.mark.parametrize(
    "method, path, body",
    [
        ("GET", "/v1/models/gpt-4", None),
        ("POST", "/tokenize", {"model": "gpt-4", "prompt": "hi"}),
        ("POST", "/tokenize", {"model": "gpt-4", "messages": HI}),
        ("POST", "/detokenize", {"model": "gpt-4", "tokens": [1]}),
    ],
    ids=["card", "tokenize", "tokenize_chat", "detokenize"],
)
def test_unknown_model_is_a_404_like_chat(server, method, path, body):
    url = server[0]
    key = ("fastdeploy:request_rejected_total", (("reason", "model_not_found"),))
    before = metric_samples(url).get(key, 0)
    r = httpx.request(method, url + path, json=body, timeout=5)
    chat = post(url, "/v1/chat/completions", {"model": "gpt-4", "messages": HI})
    assert r.status_code == chat.status_code == 404
    assert r.json() == chat.json()
    assert r.json()["error"]["code"] == "model_not_found"
    assert metric_samples(url)[key] - before == 2


@pytest.mark.parametrize(
    "path, body, status, fragment",
    [
        ("/tokenize", {}, 400, "missing required field 'prompt'"),
        ("/tokenize", {"prompt": "a", "messages": HI}, 400, "unknown field 'prompt'"),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/tokenize", {"prompt": "a", "extra": 1}, 400, "unknown field 'extra'"),
        ("/tokenize", {"messages": []}, 400, "messages"),
        ("/tokenize", {"messages": [{"role": "function", "content": "x"}]}, 400, "messages.0.role"),
        (
            "/tokenize",
            {"messages": [{"role": "tool", "content": "x"}]},
            400,
            "messages[0].tool_call_id is required",
        ),
        ("/tokenize", {"messages": [{"role": "user"}]}, 400, "messages[0].content is required"),
        (
            "/tokenize",
            {"messages": HI, "continue_final_message": True},
            400,
            "continue_final_message",
        ),
        (
            "/tokenize",
            {"messages": HI, "chat_template_kwargs": {"tokenize": True}},
            400,
            "'tokenize'",
        ),
        (
            "/tokenize",
            {"messages": HI, "chat_template_kwargs": {"nope": 1}},
            400,
            "chat template rejected",
        ),
        (
            "/tokenize",
            {"messages": [{"role": "assistant", "content": "BOOM"}]},
            400,
            "template exploded",
        ),
        ("/tokenize", {"prompt": "\ud83d"}, 400, "unpaired UTF-16 surrogate"),
        ("/tokenize", {"prompt": "x" * 600}, 400, "maximum context length of 128 tokens"),
        ("/tokenize", [1, 2], 400, "JSON object"),
        ("/detokenize", {"tokens": [True]}, 400, "tokens.0"),
        ("/detokenize", {"tokens": "104"}, 400, "tokens"),
        ("/detokenize", {"tokens": [1.5]}, 400, "tokens.0"),
        ("/detokenize", {}, 400, "missing required field 'tokens'"),
    ],
)
def test_hostile_bodies_are_400s_naming_the_field(server, path, body, status, fragment):
    url, engine, _ = server
    err = error_of(post(url, path, body), status)
    assert fragment in err["message"], err
    assert httpx.get(url + "/health", timeout=5).status_code == 200
    assert not engine.requests


def test_malformed_json_and_form_bodies_are_400s(server):
    url = server[0]
    for path in ("/tokenize", "/detokenize"):
        r = httpx.post(
            url + path,
            content=b'{"prompt": ',
            headers={"content-type": "application/json"},
            timeout=5,
        )
        assert "malformed JSON body" in error_of(r, 400)["message"]
        r = httpx.post(url + path, data={"prompt": "hi"}, timeout=5)
        assert "Content-Type" in error_of(r, 400)["message"]


def test_the_body_size_limit_applies():
    with fake_server(MODEL, limits=HTTPLimits(max_body_bytes=1000)) as (url, _, _):
        assert post(url, "/tokenize", {"prompt": "x" * 100}).status_code == 200
        assert post(url, "/tokenize", {"prompt": "x" * 2000}).status_code == 413
        assert post(url, "/detokenize", {"tokens": [97] * 1000}).status_code == 413


def test_api_key_guards_the_tokenizer_routes_but_not_the_probes():
    key = {"Authorization": "Bearer k-1"}
    with fake_server(MODEL, api_keys=("k-1",)) as (url, _, _):
        for path, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [97]})):
            assert error_of(post(url, path, body), 401)["code"] == "invalid_api_key"
            assert post(url, path, body, headers=key).status_code == 200
        r = httpx.get(url + f"/v1/models/{MODEL}", timeout=5)
        assert error_of(r, 401)["code"] == "invalid_api_key"
        assert httpx.get(url + f"/v1/models/{MODEL}", headers=key, timeout=5).status_code == 200
        assert httpx.get(url + "/version", timeout=5).json() == {"version": fastdeploy.__version__}
        assert httpx.get(url + "/ping", timeout=5).status_code == 200
        assert httpx.post(url + "/ping", timeout=5).status_code == 200
