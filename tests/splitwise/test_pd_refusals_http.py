"""A decode node's HTTP refusals of a decode leg release the prefill node's blocks at once
(before the lease ends), whatever refused it: the prompt fingerprint, the model name, a field the
request models reject, a sampling value. A mixed server never sends an ABORT anywhere. Real tiny
engines (random-weight Llama, float32, CPU) behind in-thread servers, KV over ``tcp``."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import httpx
import pytest
from tiny_models import tiny_llama

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "entrypoints"))
from http_server_utils import serve_in_thread  # noqa: E402

from fastdeploy.engine.args_utils import EngineArgs  # noqa: E402
from fastdeploy.engine.engine import LLMEngine  # noqa: E402
from fastdeploy.splitwise.side_channel import SideChannelServer  # noqa: E402

LEASE_S = 30.0


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_llama_pd_http")
    (d / "config.json").write_text(json.dumps(tiny_llama(num_hidden_layers=2)))
    return str(d)


def engine(tiny_dir, role: str) -> LLMEngine:
    args = EngineArgs(
        model=tiny_dir,
        load_format="dummy",
        skip_tokenizer_init=True,
        max_model_len=256,
        block_size=16,
        max_num_seqs=4,
        num_gpu_blocks_override=64,
        seed=0,
        device="cpu",
        splitwise_role=role,
        cache_transfer_protocol="tcp",
        pd_lease_s=LEASE_S,
    )
    return LLMEngine.from_engine_args(args)


@pytest.fixture(scope="module")
def nodes(tiny_dir):
    """``(prefill URL, prefill engine, decode URL)``."""
    prefill, decode = engine(tiny_dir, "prefill"), engine(tiny_dir, "decode")
    try:
        with serve_in_thread(prefill) as (p_url, _), serve_in_thread(decode) as (d_url, _):
            yield p_url, prefill, d_url
    finally:
        prefill.shutdown()
        decode.shutdown()


PROMPT = [(7 * i) % 400 + 3 for i in range(40)]
OTHER = [(11 * i) % 400 + 3 for i in range(40)]  # the same length, another prompt


def body(prompt=PROMPT, **extra) -> dict:
    return {"prompt": prompt, "max_tokens": 4, "temperature": 0, **extra}


def prefill_leg(p_url: str) -> dict:
    leg = body(kv_transfer_params={"do_remote_decode": True}, max_tokens=1)
    r = httpx.post(p_url + "/v1/completions", json=leg, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


def wait_released(prefill: LLMEngine, timeout_s: float = 5.0) -> float:
    """Seconds until the prefill node holds no pending send (fails after ``timeout_s``)."""
    t0 = time.monotonic()
    while prefill.pd.control.num_pending:
        assert time.monotonic() - t0 < timeout_s, "the prefill node still holds the blocks"
        time.sleep(0.02)
    return time.monotonic() - t0


@pytest.mark.parametrize(
    ("change", "status", "message"),
    [
        ({"prompt": OTHER}, 400, "kv_transfer_params.prompt_hash="),
        ({"model": "no-such-model"}, 404, "does not exist"),
        ({"no_such_field": 1}, 400, "no_such_field"),
        ({"temperature": -1}, 400, "temperature"),
    ],
    ids=["other-prompt", "unknown-model", "unknown-field", "bad-temperature"],
)
def test_a_refused_decode_leg_releases_the_prefill_blocks(nodes, change, status, message):
    p_url, prefill, d_url = nodes
    params = prefill_leg(p_url)
    assert prefill.pd.control.num_pending == 1
    leg = body(kv_transfer_params=params) | change
    r = httpx.post(d_url + "/v1/completions", json=leg, timeout=60)
    assert r.status_code == status, r.text
    assert message in r.json()["error"]["message"]
    assert wait_released(prefill) < 5.0 < LEASE_S
    assert prefill.pd.control.counts["expired"] == 0


def test_the_fingerprint_refusal_names_both_hashes_and_the_honest_leg_still_works(nodes):
    from fastdeploy.splitwise.protocol import prompt_fingerprint

    p_url, prefill, d_url = nodes
    params = prefill_leg(p_url)
    assert params["prompt_hash"] == prompt_fingerprint(PROMPT)
    r = httpx.post(d_url + "/v1/completions", json=body(OTHER, kv_transfer_params=params))
    assert r.status_code == 400
    error = r.json()["error"]["message"]
    assert repr(params["prompt_hash"]) in error and repr(prompt_fingerprint(OTHER)) in error
    wait_released(prefill)
    params = prefill_leg(p_url)
    r = httpx.post(d_url + "/v1/completions", json=body(kv_transfer_params=params), timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
    wait_released(prefill)
    assert prefill.pd.control.counts["done"] >= 1


def test_a_mixed_server_refuses_a_decode_leg_without_contacting_anyone(tiny_dir):
    """A server that is not a decode node makes no outbound connection for a client's
    ``kv_transfer_params`` (that would let any client make it connect anywhere)."""
    seen = []
    side = SideChannelServer("127.0.0.1", 0, lambda op, m: seen.append(op) or {}).start()
    mixed = engine(tiny_dir, "mixed")
    try:
        with serve_in_thread(mixed) as (url, _):
            params = {
                "remote_engine_id": "p0",
                "remote_request_id": "p-1",
                "remote_host": "127.0.0.1",
                "remote_port": side.port,
                "remote_block_ids": [1],
            }
            r = httpx.post(url + "/v1/completions", json=body(kv_transfer_params=params))
            assert r.status_code == 400 and "invalid on a mixed node" in r.text
            time.sleep(0.3)
            assert seen == []
    finally:
        mixed.shutdown()
        side.close()
