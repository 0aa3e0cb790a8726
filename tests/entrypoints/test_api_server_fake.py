"""The HTTP layer against a fake engine: routes, streaming, metrics, disconnects (fast). Bad input
and refusals are in ``test_api_server_validation.py``.

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
from http_server_utils import fake_server, get_json, metric_samples, serve_in_thread, wait_until

# The official client is a test extra; a GPU-only host without it still collects this module.
openai = pytest.importorskip("openai")
MODEL = "fake-model"
TOK = FakeTokenizer()


def chat_prompt_ids(content: str) -> list[int]:
    text = TOK.apply_chat_template([{"role": "user", "content": content}])
    return TOK.encode(text)


@pytest.fixture(scope="module")
def server():
    with fake_server(MODEL) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0, timeout=20)


def test_health_models_and_server_info(server, client):
    url, engine, _ = server
    assert httpx.get(url + "/health", timeout=5).status_code == 200
    assert [m.id for m in client.models.list().data] == [MODEL]
    info = get_json(url, "/v1/server_info")
    assert info["max_model_len"] == 128 and info["deployment_plan"]["reasons"] == ["fake engine"]
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
    before = metric_samples(url)
    client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "m"}], max_tokens=4
    )
    after = metric_samples(url)

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


def test_only_text_prompts_take_the_tokenizing_thread(client, monkeypatch):
    from fastdeploy.entrypoints.openai.serving_completion import has_text
    from fastdeploy.entrypoints.openai.serving_utils import OpenAIServing

    calls = []
    real = OpenAIServing.off_loop

    async def counting(self, fn, *args):
        calls.append(fn.__name__)
        return await real(self, fn, *args)

    monkeypatch.setattr(OpenAIServing, "off_loop", counting)
    ids = TOK.encode("hi there")
    for prompt in (ids, [ids]):
        done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0)
        assert done.usage.prompt_tokens == len(ids)
        assert done.choices[0].text == expected_text(ids, 3)
    assert calls == []
    for prompt in ("hi there", ["hi there"]):
        done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0)
        assert done.usage.prompt_tokens == len(ids)
    assert calls == ["tokenize_prompts", "tokenize_prompts"]
    assert [has_text(p) for p in ("", "a", ["a"], [1], [[1]], [])] == [
        True, True, True, False, False, False,
    ]  # fmt: skip
