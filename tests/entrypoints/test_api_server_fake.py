"""The HTTP layer against a fake engine: routes, streaming, errors, metrics, disconnects (fast).

The server runs with uvicorn on a thread at 127.0.0.1 and is called over real HTTP with the
official ``openai`` client and ``httpx``.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from fake_llm_engine import FakeEngine, FakeTokenizer, expected_text
from http_server_utils import get_json, serve_in_thread, wait_until
from prometheus_client.parser import text_string_to_metric_families

# The official client is a test extra; a GPU-only host without it still collects this module.
openai = pytest.importorskip("openai")
MODEL = "fake-model"
TOK = FakeTokenizer()


def chat_prompt_ids(content: str) -> list[int]:
    text = TOK.apply_chat_template([{"role": "user", "content": content}])
    return TOK.encode(text)


@pytest.fixture(scope="module")
def server():
    engine = FakeEngine(max_model_len=128, step_delay_s=0.002)
    with serve_in_thread(engine, MODEL, max_concurrency=64) as (url, async_engine):
        yield url, engine, async_engine


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0, timeout=20)


def test_health_models_and_server_info(server, client):
    url, engine, _ = server
    assert httpx.get(url + "/health", timeout=5).status_code == 200
    assert [m.id for m in client.models.list().data] == [MODEL]
    info = get_json(url, "/v1/server_info")
    assert info["max_model_len"] == 128 and info["graph_plan"]["reasons"] == ["fake engine"]
    assert "model_config" in info["config"]


def test_chat_completion_text_and_usage(client):
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=7, temperature=0
    )
    ids = chat_prompt_ids("hi")
    assert resp.choices[0].message.content == expected_text(ids, 7)
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.prompt_tokens == len(ids)
    assert resp.usage.completion_tokens == 7 and resp.usage.total_tokens == len(ids) + 7


def test_openai_fields_at_their_defaults_are_accepted(client):
    resp = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        frequency_penalty=0,
        presence_penalty=0,
        logit_bias={},
        response_format={"type": "text"},
        store=False,
        metadata={"k": "v"},
        parallel_tool_calls=True,
    )
    assert resp.usage.completion_tokens == 4
    done = client.completions.create(model=MODEL, prompt="hi", max_tokens=3, echo=False, best_of=1)
    assert done.usage.completion_tokens == 3


def test_max_completion_tokens_wins(client):
    resp = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=9,
        max_completion_tokens=3,
    )
    assert resp.usage.completion_tokens == 3


def test_chat_stream_equals_non_stream_with_usage_chunk(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "stream me"}], max_tokens=12)
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(
        client.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **kwargs
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_sse_wire_format(server):
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "stream": True}
    with httpx.stream("POST", server[0] + "/v1/chat/completions", json=body, timeout=10) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events[:-1])


def test_completion_text_token_ids_and_logprobs(client):
    resp = client.completions.create(model=MODEL, prompt="abc", max_tokens=5, logprobs=2)
    assert resp.choices[0].text == expected_text(TOK.encode("abc"), 5)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == 5 and lp.token_logprobs == [-0.25] * 5
    assert len(lp.top_logprobs[0]) == 2
    by_ids = client.completions.create(model=MODEL, prompt=TOK.encode("abc"), max_tokens=5)
    assert by_ids.choices[0].text == resp.choices[0].text
    streamed = client.completions.create(model=MODEL, prompt="abc", max_tokens=5, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == resp.choices[0].text


def test_chat_logprobs(client):
    resp = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "q"}],
        max_tokens=3,
        logprobs=True,
        top_logprobs=1,
    )
    content = resp.choices[0].logprobs.content
    assert [c.token for c in content] == list(resp.choices[0].message.content)
    assert all(len(c.top_logprobs) == 1 for c in content)


def test_stop_string_finishes_request_in_engine(server, client):
    _, engine, _ = server
    ids = chat_prompt_ids("stop test")
    full = expected_text(ids, 20)
    stop = full[5:7]
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "stop test"}], max_tokens=20, stop=stop
    )
    assert resp.choices[0].message.content == full[: full.index(stop)]
    assert resp.choices[0].finish_reason == "stop"
    # The engine's stop checker ended it in the step that completed the stop string.
    assert engine.finished[resp.id] == "stop" and resp.id not in engine.aborted
    assert resp.usage.completion_tokens == full.index(stop) + len(stop)


def test_concurrent_requests_are_independent(client):
    prompts = [f"prompt number {i}" for i in range(8)]

    def run(p):
        return (
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": p}], max_tokens=10
            )
            .choices[0]
            .message.content
        )

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(run, prompts))
    assert results == [expected_text(chat_prompt_ids(p), 10) for p in prompts]


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
    ({"messages": [{"role": "user", "content": "x"}], "n": 2}, 400, ["n=2"], "n"),
    (
        {"messages": [{"role": "user", "content": "x"}], "presence_penalty": 2.5},
        400,
        ["presence_penalty=2.5 is invalid; allowed: a number in [-2, 2]"],
        "presence_penalty",
    ),
    (
        {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
        400,
        ["tools is not supported"],
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
        ({"prompt": ["a", "b"]}, "one per request"),
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


def samples(url: str) -> dict:
    """``{(sample name, sorted labels): value}`` of ``/metrics``."""
    text = httpx.get(url + "/metrics", timeout=5).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_every_refusal_is_counted_by_reason(server):
    url = server[0]
    chat = url + "/v1/chat/completions"
    msg = [{"role": "user", "content": "x"}]
    refusals = [
        (chat, {"messages": msg, "n": 2}, 400, "invalid"),
        (chat, {"messages": msg, "stop": [""]}, 400, "invalid"),
        (chat, {"messages": msg, "top_logprobs": 2}, 400, "invalid"),
        (chat, {"messages": msg, "temperature": "hot"}, 400, "invalid"),
        (chat, {"messages": msg, "model": "gpt-9"}, 404, "model_not_found"),
        (url + "/v1/completions", {"prompt": [5] * 200}, 400, "context_length"),
    ]
    for route, body, status, reason in refusals:
        before = samples(url)
        r = httpx.post(route, json=body, timeout=10)
        assert r.status_code == status, r.text
        key = ("fastdeploy:request_rejected_total", (("reason", reason),))
        assert samples(url)[key] - before.get(key, 0) == 1, (body, reason)


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
    assert r.json()["error"]["message"] == "tools is not supported (only null or empty)"


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


def test_penalties_and_logit_bias_are_accepted(client):
    resp = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "ok"}],
        max_tokens=3,
        frequency_penalty=0.5,
        presence_penalty=-0.5,
        logit_bias={"97": 10},
        extra_body={"repetition_penalty": 1.1},
    )
    assert resp.choices[0].finish_reason == "length"


def test_metrics_parse_and_move(server, client):
    url = server[0]
    before = samples(url)
    client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "m"}], max_tokens=4
    )
    after = samples(url)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    assert delta("fastdeploy:request_success_total", finished_reason="length") == 1
    assert delta("fastdeploy:generation_tokens_total") == 4
    assert delta("fastdeploy:prompt_tokens_total") == len(chat_prompt_ids("m"))
    assert delta("fastdeploy:time_to_first_token_seconds_count") == 1
    assert delta("fastdeploy:e2e_request_latency_seconds_count") == 1
    assert delta("fastdeploy:time_per_output_token_seconds_count") == 3
    assert delta("fastdeploy:steps_total", mode="eager") >= 4
    assert delta("fastdeploy:padded_tokens_total") >= 8
    assert ("fastdeploy:gpu_cache_usage_perc", ()) in after


def test_client_disconnect_aborts_and_frees(server):
    url, engine, async_engine = server
    engine.step_delay_s = 0.02
    try:
        body = {
            "messages": [{"role": "user", "content": "long"}],
            "max_tokens": 100,
            "stream": True,
        }
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=10) as r:
            lines = r.iter_lines()
            first = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
            next(lines)
        request_id = first["id"]
        wait_until(lambda: request_id in engine.aborted, 5, "the engine to abort the request")

        def idle():
            info = get_json(url, "/v1/server_info")
            stats = info["stats"]
            return (
                info["num_in_flight"] == 0
                and stats["num_running"] == 0
                and stats["num_free_blocks"] == stats["num_total_blocks"]
            )

        wait_until(idle, 5, "no running request and all blocks free")
    finally:
        engine.step_delay_s = 0.002


def test_engine_calls_stay_on_one_thread(server):
    _, engine, _ = server
    assert len(engine.thread_ids) == 1
    assert threading.get_ident() not in engine.thread_ids


def test_queue_full_gives_429_with_retry_after():
    engine = FakeEngine(step_delay_s=0.05)
    with serve_in_thread(engine, MODEL, max_concurrency=1) as (url, _):
        body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 40, "stream": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=10) as r:
            lines = r.iter_lines()  # keep a reference: a dropped iterator closes the stream
            next(lines)
            second = httpx.post(url + "/v1/chat/completions", json=body, timeout=10)
            assert second.status_code == 429
            assert int(second.headers["retry-after"]) >= 1
            assert "max-concurrency" in second.json()["error"]["message"]
        assert httpx.get(url + "/health", timeout=5).status_code == 200


def test_engine_failure_fails_requests_with_503():
    engine = FakeEngine()
    with serve_in_thread(engine, MODEL) as (url, _):
        engine.fail_next_step = True
        body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=10)
        assert r.status_code == 503 and "simulated device failure" in r.json()["error"]["message"]
        assert httpx.get(url + "/health", timeout=5).status_code == 503
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=10)
        assert r.status_code == 503
    assert engine.is_shut_down


def test_non_streaming_client_timeout_aborts(server):
    url, engine, _ = server
    engine.step_delay_s = 0.02
    try:
        body = {"messages": [{"role": "user", "content": "patience"}], "max_tokens": 100}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/chat/completions", json=body, timeout=0.3)
        wait_until(
            lambda: get_json(url, "/v1/server_info")["num_in_flight"] == 0,
            5,
            "the abandoned request to be aborted",
        )
        assert engine.aborted
    finally:
        engine.step_delay_s = 0.002


def test_validation_message_merges_union_branches_only():
    from fastdeploy.entrypoints.openai.serving_utils import validation_message

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
