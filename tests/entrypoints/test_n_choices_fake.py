"""``n > 1`` and several prompts in one completion request, over real HTTP against the fake engine
(fast), through the official ``openai`` client: choice indexes (``i * n + j``), one chunk per choice
and step with its index, usage counting each prompt once, each choice's seed ``seed + j``, the
siblings admitted only after the first choice's first step (so the real engine's prefix cache holds
the prompt: ``test_server_n_choices.py`` shows the counter), abort of every choice when the client
leaves, and refusals. The fake engine's output is a function of the prompt and the seed only
(:func:`fake_llm_engine.fake_token`)."""

from __future__ import annotations

import json
from collections import defaultdict

import httpx
import pytest
from fake_llm_engine import FakeTokenizer, expected_text
from http_server_utils import fake_server, wait_until

openai = pytest.importorskip("openai")
MODEL = "fake-model"
TOK = FakeTokenizer()


@pytest.fixture(scope="module")
def server():
    with fake_server(MODEL) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0, timeout=20)


def chat_ids(content: str) -> list[int]:
    return TOK.encode(TOK.apply_chat_template([{"role": "user", "content": content}]))


def assert_idle(engine) -> None:
    wait_until(lambda: not engine.requests, 10, "no request left in the engine")


def test_completion_n_choices_and_usage(server, client):
    engine = server[1]
    resp = client.completions.create(model=MODEL, prompt="hello", n=3, max_tokens=5)
    ids = TOK.encode("hello")
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert [c.text for c in resp.choices] == [expected_text(ids, 5)] * 3  # no seed: same fn
    assert [c.finish_reason for c in resp.choices] == ["length"] * 3
    usage = resp.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(ids), 15)
    assert usage.total_tokens == len(ids) + 15
    # One engine request per choice; the siblings came after the first choice's first step.
    rids = [f"{resp.id}-{j}" for j in range(3)]
    assert all(engine.finished[r] == "length" for r in rids)
    first = engine.added_at_step[rids[0]]
    assert engine.added_at_step[rids[1]] == engine.added_at_step[rids[2]] > first
    assert_idle(engine)


def test_seeded_choices_have_their_own_seed_and_reproduce(client):
    ids = chat_ids("pick")

    def texts(**kw) -> list[str]:
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "pick"}], max_tokens=6, **kw
        )
        return [c.message.content for c in sorted(r.choices, key=lambda c: c.index)]

    got = texts(n=4, seed=11)
    assert got == [expected_text(ids, 6, 11 + j) for j in range(4)]
    assert len(set(got)) == 4  # every choice sampled with its own seed
    assert texts(n=4, seed=11) == got  # reproducible
    assert texts(n=1, seed=11) == got[:1]  # choice 0 keeps the request's seed


def test_chat_stream_n_choices(client):
    ids = chat_ids("stream me")
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "stream me"}],
        n=3,
        seed=5,
        max_tokens=7,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, roles, reasons, usage = defaultdict(str), defaultdict(int), {}, None
    for chunk in stream:
        if chunk.usage is not None:
            assert chunk.choices == [] and usage is None
            usage = chunk.usage
            continue
        assert len(chunk.choices) == 1  # each chunk carries one choice, with its index
        c = chunk.choices[0]
        if c.delta.role is not None:
            roles[c.index] += 1
        text[c.index] += c.delta.content or ""
        if c.finish_reason is not None:
            assert c.index not in reasons
            reasons[c.index] = c.finish_reason
    assert roles == {0: 1, 1: 1, 2: 1}
    assert dict(text) == {j: expected_text(ids, 7, 5 + j) for j in range(3)}
    assert reasons == {0: "length", 1: "length", 2: "length"}
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(ids), 21)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("as_ids", [False, True], ids=["strings", "token-ids"])
def test_batched_prompts_indexed_as_openai(server, client, stream, as_ids):
    prompts = ["ab", "xyz"]
    ids = [TOK.encode(p) for p in prompts]
    body = dict(model=MODEL, prompt=ids if as_ids else prompts, n=2, seed=3, max_tokens=4)
    text, reasons = defaultdict(str), {}
    if stream:
        for chunk in client.completions.create(
            **body, stream=True, stream_options={"include_usage": True}
        ):
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                text[c.index] += c.text
                if c.finish_reason is not None:
                    reasons[c.index] = c.finish_reason
    else:
        resp = client.completions.create(**body)
        usage = resp.usage
        assert [c.index for c in resp.choices] == [0, 1, 2, 3]
        for c in resp.choices:
            text[c.index], reasons[c.index] = c.text, c.finish_reason
    # prompt i, choice j -> index i * n + j
    want = {i * 2 + j: expected_text(ids[i], 4, 3 + j) for i in range(2) for j in range(2)}
    assert dict(text) == want
    assert reasons == dict.fromkeys(range(4), "length")
    assert usage.prompt_tokens == 5 and usage.completion_tokens == 16
    assert_idle(server[1])


def test_batch_of_prompts_with_n1_runs_them_together(server, client):
    engine = server[1]
    resp = client.completions.create(model=MODEL, prompt=["a", "bb", "ccc"], max_tokens=3)
    assert [c.text for c in resp.choices] == [expected_text(TOK.encode(p), 3) for p in
                                              ("a", "bb", "ccc")]  # fmt: skip
    rids = [f"{resp.id}-{i}" for i in range(3)]
    assert len({engine.added_at_step[r] for r in rids}) == 1  # no wait: n=1 shares nothing
    assert resp.usage.prompt_tokens == 6 and resp.usage.completion_tokens == 9


def test_client_leaving_aborts_every_choice(server):
    url, engine, _ = server
    engine.step_delay_s = 0.02
    try:
        body = {"prompt": ["left", "right"], "n": 3, "max_tokens": 100, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=20) as r:
            seen = set()
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    seen.add(chunk["choices"][0]["index"])
                    rid = chunk["id"]
                if len(seen) == 6:
                    break
        wait_until(lambda: not engine.requests, 10, "no request left in the engine")
        aborted = {a for a in engine.aborted if a.startswith(rid + "-")}
        assert aborted == {f"{rid}-{k}" for k in range(6)}
    finally:
        engine.step_delay_s = 0.002


def test_one_bad_prompt_in_a_batch_runs_none(server):
    url, engine, _ = server
    before = set(engine.aborted)
    r = httpx.post(url + "/v1/completions", json={"prompt": ["fine", ""], "n": 2}, timeout=10)
    assert r.status_code == 400 and "empty" in r.json()["error"]["message"], r.text
    assert_idle(engine)
    # The first prompt's first choice was admitted before the second prompt was refused.
    assert len(set(engine.aborted) - before) == 1


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"n": 2, "best_of": 3}, "best_of", "best_of=3 is not supported with n=2"),
        ({"n": 3, "best_of": 2}, "best_of", "allowed: null or 3"),
        ({"n": 200}, "n", "n=200 is invalid; allowed: an integer in [1, 128]"),
        ({"n": 2, "kv_transfer_params": {"do_remote_decode": True}}, "n", "a PD leg"),
    ],
)
def test_refusals_name_the_field(server, body, param, words):
    r = httpx.post(server[0] + "/v1/completions", json={"prompt": "x", **body}, timeout=10)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and words in err["message"], r.text


def test_best_of_equal_to_n_is_n(client):
    resp = client.completions.create(model=MODEL, prompt="b", n=2, best_of=2, max_tokens=2)
    assert len(resp.choices) == 2


def test_more_choices_than_the_concurrency_limit_is_a_400_not_a_429():
    """A request whose prompts x n exceed the server's concurrent-request limit could never be
    admitted: 400 naming n (or prompt when n=1) and the limit, not a 429 to retry."""
    from fastdeploy.entrypoints.openai.choices import check_n
    from fastdeploy.entrypoints.openai.errors import APIError

    check_n(4, 128, max_choices=512)  # exactly at the limit
    with pytest.raises(APIError) as e:
        check_n(128, 100, max_choices=512)
    assert e.value.status == 400 and e.value.param == "n"
    assert "12800 choices" in e.value.message and "at most 512" in e.value.message
    with pytest.raises(APIError) as e:
        check_n(1, 1000, max_choices=512)
    assert e.value.param == "prompt"
