"""``n > 1`` and batched prompts on the default model (the engine of
``test_server_prefix_cache_usage.py``: prefix caching on, 16-token blocks), through the official
``openai`` client, streamed and not:

* ``n=4`` prefills the prompt once: of the four engine requests, the first computes the prompt
  and the three others find its whole blocks in the prefix cache (``fastdeploy:prefix_cache_hits``
  grows by 3 x 96 tokens for a 100-token prompt, ``fastdeploy:prefix_cache_queries`` by 4 x 100);
* seeded ``n=4`` answers the same four texts again;
* batched prompts are answered at OpenAI's indexes (prompt i, choice j -> i * n + j), each equal to
  the prompt's answer alone (greedy);
* a client that leaves a streamed ``n=4`` aborts all four: every KV block is free again;
* an image part and ``best_of > n`` are refused by name.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
from http_server_utils import metric_samples, wait_until
from server_process import wait_all_blocks_free
from test_server_prefix_cache_usage import MODEL, server  # noqa: F401 - the module's engine

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(server):  # noqa: F811 - the imported fixture
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=120)


def prefix_counters(url: str) -> tuple[float, float]:
    """``(prefix-cache queries, hits)`` in tokens, from ``/metrics``."""
    samples = metric_samples(url)
    return (
        samples[("fastdeploy:prefix_cache_queries_total", ())],
        samples[("fastdeploy:prefix_cache_hits_total", ())],
    )


def completion_texts(client, stream: bool, **body) -> tuple[dict[int, str], object]:
    """``({choice index: text}, usage)`` of one completion request."""
    if not stream:
        resp = client.completions.create(model=MODEL, **body)
        return {c.index: c.text for c in resp.choices}, resp.usage
    texts, usage = defaultdict(str), None
    chunks = client.completions.create(
        model=MODEL, stream=True, stream_options={"include_usage": True}, **body
    )
    for chunk in chunks:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.text
    return dict(texts), usage


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_n4_prefills_the_prompt_once(server, client, stream):  # noqa: F811
    start = 5000 if stream else 7000  # each case's own token ids: nothing cached before
    prompt = [start + 3 * i for i in range(100)]  # 6 whole blocks and 4 tokens
    queries0, hits0 = prefix_counters(server)
    texts, usage = completion_texts(
        client, stream, prompt=prompt, n=4, max_tokens=3, extra_body={"ignore_eos": True}
    )
    assert sorted(texts) == [0, 1, 2, 3]
    assert usage.prompt_tokens == 100 and usage.completion_tokens == 12
    assert usage.prompt_tokens_details.cached_tokens == 0  # the first choice prefilled it
    wait_until(lambda: prefix_counters(server)[0] >= queries0 + 400, 30, "the queries counted")
    queries, hits = prefix_counters(server)
    print(f"n=4, 100-token prompt: prefix-cache queries +{queries - queries0:.0f}, "
          f"hits +{hits - hits0:.0f} tokens")  # fmt: skip
    assert queries - queries0 == 400  # four engine requests looked the prompt up
    assert hits - hits0 == 3 * 96  # three found its 6 whole blocks: one prefill


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_seeded_n4_reproduces(client, stream):
    messages = [{"role": "user", "content": f"Name a colour ({'sse' if stream else 'json'})."}]

    def answer() -> dict[int, str]:
        body = dict(model=MODEL, messages=messages, n=4, seed=1234, max_tokens=8, temperature=1)
        if not stream:
            resp = client.chat.completions.create(**body)
            return {c.index: c.message.content for c in resp.choices}
        texts = defaultdict(str)
        for chunk in client.chat.completions.create(**body, stream=True):
            for c in chunk.choices:
                texts[c.index] += c.delta.content or ""
        return dict(texts)

    first = answer()
    assert sorted(first) == [0, 1, 2, 3]
    assert len(set(first.values())) > 1  # each choice samples with its own seed
    assert answer() == first


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_batched_prompts_answer_each_prompt(client, stream):
    prompts = ["The capital of France is", "One, two, three,"]
    alone = [
        completion_texts(client, False, prompt=p, max_tokens=6, temperature=0)[0][0]
        for p in prompts
    ]
    texts, usage = completion_texts(
        client, stream, prompt=prompts, n=2, max_tokens=6, temperature=0
    )
    # prompt i, choice j -> index i * n + j; greedy choices of one prompt agree
    assert texts == {0: alone[0], 1: alone[0], 2: alone[1], 3: alone[1]}
    ids = client.completions.create(model=MODEL, prompt=prompts, max_tokens=1).usage
    assert usage.prompt_tokens == ids.prompt_tokens  # each prompt counted once


def test_image_and_best_of_are_refused_by_name(client):
    image = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": [{"type": "text", "text": "What?"}, image]}],
        )
    assert "images are not supported" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", n=2, best_of=4)
    assert "best_of=4 is not supported with n=2" in str(e.value)


def test_leaving_a_stream_aborts_every_choice_and_frees_every_block(server, client):  # noqa: F811
    aborts = ("fastdeploy:request_success_total", (("finished_reason", "abort"),))
    aborted0 = metric_samples(server).get(aborts, 0)
    prompt = [9000 + 5 * i for i in range(70)]
    chunks = client.completions.create(
        model=MODEL, prompt=prompt, n=4, max_tokens=500, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    seen = set()
    for chunk in chunks:
        seen.update(c.index for c in chunk.choices)
        if seen == {0, 1, 2, 3}:
            break
    chunks.close()  # the client leaves with every choice running
    assert seen == {0, 1, 2, 3}
    wait_until(lambda: metric_samples(server).get(aborts, 0) >= aborted0 + 4, 30, "4 aborts")
    assert metric_samples(server)[aborts] == aborted0 + 4  # none ran on to its 500 tokens
    free, total = wait_all_blocks_free(server, timeout_s=30)
    assert free == total


def test_prompt_logprobs_and_echo_reach_every_choice(server, client):  # noqa: F811
    prompt = "The quick brown fox jumps over the lazy dog"
    resp = client.completions.create(
        model=MODEL, prompt=prompt, n=3, max_tokens=2, temperature=0,
        extra_body={"prompt_logprobs": 1},
    )  # fmt: skip
    entries = [c.model_extra["prompt_logprobs"] for c in resp.choices]
    assert entries[0] is not None and entries[0][0] is None and len(entries[0]) > 5
    assert entries[1] == entries[0] and entries[2] == entries[0]  # computed once, by choice 0
    echoed = client.completions.create(
        model=MODEL, prompt=prompt, n=2, max_tokens=2, temperature=0, echo=True, logprobs=1
    )
    for c in echoed.choices:
        assert c.text.startswith(prompt) and c.logprobs.token_logprobs[0] is None
        assert len(c.logprobs.tokens) == resp.usage.prompt_tokens + 2
