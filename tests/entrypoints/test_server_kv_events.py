"""``fastdeploy serve --kv-events-config`` with the default model (its engine in a process of its
own): a subscriber with its own structs sees the prompt's blocks stored with the hashes a router
computes from the token ids under the server's ``PYTHONHASHSEED``, and can replay from seq 0."""

from __future__ import annotations

import hashlib
import json
import pickle

import httpx
import pytest
from http_server_utils import free_port
from kv_event_subscriber import DECODER, BlockStored, Subscriber
from server_process import serve

pytestmark = pytest.mark.slow

BLOCK = 16
SEED = "7"


def router_chain(token_ids: list[int]) -> list[int]:
    def digest(obj) -> bytes:
        return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()

    parent, out = digest(SEED), []
    for i in range(len(token_ids) // BLOCK):
        parent = digest((parent, tuple(token_ids[i * BLOCK : (i + 1) * BLOCK]), None))
        out.append(int.from_bytes(parent[-8:], "big"))
    return out


def test_server_publishes_the_prompts_blocks(tmp_path):
    sub = Subscriber("fd")
    replay = f"tcp://127.0.0.1:{free_port()}"
    events = {
        "enable_kv_cache_events": True,
        "endpoint": sub.endpoint,
        "replay_endpoint": replay,
        "topic": "fd",
    }
    args = ["--block-size", str(BLOCK), "--max-num-seqs", "2", "--max-model-len", "512"]
    args += ["--kv-events-config", json.dumps(events)]
    try:
        with serve(tmp_path, *args, env={"PYTHONHASHSEED": SEED}) as server:
            prompt = [(i * 37) % 5000 + 10 for i in range(70)]  # 4 full blocks + 6 tokens
            body = {
                "model": "SmolLM2-135M-Instruct",
                "prompt": prompt,
                "max_tokens": 3,
                "temperature": 0,
            }
            r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            sub.drain(1000)
            replayed = sub.replay(replay, 0)
        assert replayed and sorted(replayed) == list(range(len(replayed)))
        stored = [
            e
            for s in sorted(replayed)
            for e in DECODER.decode(replayed[s]).events
            if isinstance(e, BlockStored)
        ]
        first = [e for e in stored if e.parent_block_hash is None]
        assert first and first[0].token_ids == prompt[: 4 * BLOCK]
        assert first[0].block_hashes == router_chain(prompt)
        assert (first[0].block_size, first[0].medium) == (BLOCK, "GPU")
    finally:
        sub.close()
