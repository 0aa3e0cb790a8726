"""The server with the default model, a tiny KV pool and no tokenizer (the issue's
``--num-gpu-blocks-override 6 --block-size 16`` and ``--skip-tokenizer-init``), in a thread.

A prompt that can never fit the pool is refused at once with the numbers, and the requests behind
it are served; streamed completions carry each step's token ids when there is no text.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
from http_server_utils import serve_in_thread

from fastdeploy.engine.args_utils import EngineArgs

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server():
    from fastdeploy.engine.engine import LLMEngine

    args = EngineArgs(
        num_gpu_blocks_override=6, block_size=16, max_num_seqs=4, skip_tokenizer_init=True
    )
    try:
        engine = LLMEngine.from_engine_args(args)
    except FileNotFoundError as e:
        pytest.skip(str(e))
    with serve_in_thread(engine, MODEL) as (url, async_engine):
        yield url, engine


def complete(url: str, **body) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": MODEL, **body}, timeout=60)


def test_a_prompt_that_can_never_fit_the_pool_is_refused_at_once(server):
    url, engine = server
    assert engine.max_model_len == 80  # 5 usable blocks of 16 tokens: lowered from 8192
    started = time.monotonic()
    r = complete(url, prompt=list(range(100, 221)), max_tokens=4)  # 121 tokens
    assert time.monotonic() - started < 5
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == ("prompt", "context_length_exceeded")
    for number in ("121 tokens", "max_model_len is 80", "5 blocks of 16 tokens", "8192"):
        assert number in err["message"], err["message"]
    # Nothing waits behind it: the next request is served.
    r = complete(url, prompt=list(range(100, 140)), max_tokens=4, temperature=0)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 4
    info = httpx.get(url + "/v1/server_info", timeout=10).json()
    assert info["max_model_len"] == 80 and "lowered from 8192 to 80" in info["max_model_len_note"]


def test_streamed_completion_sends_token_ids_each_step(server):
    url, _ = server
    body = {"model": MODEL, "prompt": list(range(100, 130)), "max_tokens": 6, "temperature": 0}
    full = complete(url, **{k: v for k, v in body.items() if k != "model"}).json()
    chunks = []
    with httpx.stream(
        "POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    per_step = [c["choices"][0]["token_ids"] for c in chunks if c["choices"]]
    assert per_step == [[t] for t in full["choices"][0]["token_ids"]]
    assert all(c["choices"][0]["text"] == "" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_text_needs_a_tokenizer(server):
    url, _ = server
    r = complete(url, prompt="hello")
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert "--skip-tokenizer-init" in r.json()["error"]["message"]
    r = httpx.post(
        url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}]},
        timeout=10,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = complete(url, prompt=[5, 6], stop=["x"])
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"
