"""The server with the default model (prefix caching on, its default) reports prompt tokens served
from the prefix cache as OpenAI's ``usage.prompt_tokens_details.cached_tokens``: 0 for a prompt it
has not seen, whole blocks of it when the same prompt comes again, for completions and chat,
streamed (the ``include_usage`` chunk) and not. A longer prompt that begins with an earlier one
(the serving benchmark's prompts at another ``--input-len``) gets the shared blocks."""

from __future__ import annotations

import json

import httpx
import pytest
from http_server_utils import serve_in_thread

from fastdeploy.engine.args_utils import EngineArgs

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
BLOCK = 16


@pytest.fixture(scope="module")
def server():
    from fastdeploy.engine.engine import LLMEngine

    args = EngineArgs(block_size=BLOCK, max_num_seqs=4, max_model_len=1024, seed=0)
    assert args.enable_prefix_caching  # the default this test is about
    try:
        engine = LLMEngine.from_engine_args(args)
    except FileNotFoundError as e:
        pytest.skip(str(e))
    with serve_in_thread(engine, MODEL) as (url, _):
        yield url
    engine.shutdown()


def usage_of(url: str, path: str, body: dict) -> dict:
    """The ``usage`` of one answer: the body's, or the closing chunk's when ``body`` streams."""
    body = {"model": MODEL, "max_tokens": 2, "temperature": 0, **body}
    if not body.get("stream"):
        r = httpx.post(url + path, json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["usage"]
    body["stream_options"] = {"include_usage": True}
    usage = None
    with httpx.stream("POST", url + path, json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk["usage"] is not None:
                    assert usage is None and chunk["choices"] == []  # one usage chunk, last
                    usage = chunk["usage"]
    assert usage is not None
    return usage


def cached(usage: dict) -> int:
    return usage["prompt_tokens_details"]["cached_tokens"]


def full_blocks_below(n: int) -> int:
    """What the prefix cache can serve of an n-token prompt seen before: whole blocks strictly
    below its last token (one token is always computed, for its logits)."""
    return (n - 1) // BLOCK * BLOCK


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_completion_prompt_sent_twice_is_cached_the_second_time(server, stream):
    start = 1000 if stream else 3000  # token ids of each case's own (no shared first block)
    prompt = [start + 7 * i for i in range(100)]  # 6 whole blocks and 4 tokens
    body = {"prompt": prompt, "stream": stream}
    first = usage_of(server, "/v1/completions", body)
    assert first["prompt_tokens"] == 100 and cached(first) == 0
    second = usage_of(server, "/v1/completions", body)
    assert second["prompt_tokens"] == 100 and second["completion_tokens"] == 2
    assert cached(second) == full_blocks_below(100) == 96


def test_a_longer_prompt_gets_the_blocks_it_shares_with_an_earlier_one(server):
    prompt = [5000 + 11 * i for i in range(150)]
    assert cached(usage_of(server, "/v1/completions", {"prompt": prompt[:70]})) == 0
    # The first 70 tokens were seen: their 4 whole blocks; the rest is a prefill.
    assert cached(usage_of(server, "/v1/completions", {"prompt": prompt})) == 64


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_chat_sent_twice_is_cached_the_second_time(server, stream):
    # A system message of each case's own: the model's default one would make the template's
    # first block the same for every conversation.
    session = "streamed" if stream else "plain"
    messages = [
        {"role": "system", "content": f"Session {session}: answer in one word."},
        {"role": "user", "content": " ".join(f"item{i}" for i in range(40))},
    ]
    body = {"messages": messages, "stream": stream}
    first = usage_of(server, "/v1/chat/completions", body)
    n = first["prompt_tokens"]
    assert n > 4 * BLOCK and cached(first) == 0
    second = usage_of(server, "/v1/chat/completions", body)
    assert second["prompt_tokens"] == n
    assert cached(second) == full_blocks_below(n) and cached(second) % BLOCK == 0
