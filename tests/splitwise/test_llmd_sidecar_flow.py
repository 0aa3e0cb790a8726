"""llm-d's P/D routing sidecar flow against our PD nodes (slow: two real servers on CPU).

The sidecar (llm-d-routing-sidecar, ``-connector=nixlv2``; ``internal/proxy/connector_nixlv2.go``)
runs next to a decode node. For a request whose ``x-prefiller-host-port`` header names a prefill
node, it

1. sends the client's body to the prefill node with ``kv_transfer_params`` replaced by
   ``{"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
   "remote_block_ids": null, "remote_host": null, "remote_port": null}``, ``"stream": false``,
   ``stream_options`` removed and ``"max_tokens": 1`` (both legs carry one new ``x-request-id``);
2. passes a non-2xx answer's status to the client and stops;
3. sends the same body to the local decode node with the client's ``stream``,
   ``stream_options`` and ``max_tokens`` put back (removed when the client had not sent them)
   and ``kv_transfer_params`` set to the prefill answer's, and streams that answer back.

:func:`sidecar` does exactly that with httpx (our ``fastdeploy router`` and vLLM's router are
tested elsewhere: ``tests/splitwise/test_pd_e2e.py``, ``tests/router/test_vllm_router.py``; the
latter's PD leg differs, it adds ``min_tokens: 1``). The reference is the same request answered
plainly by one node (a prefill node serves a request without ``kv_transfer_params`` as a mixed
node does), greedy, so the two must agree token for token.
"""

from __future__ import annotations

import uuid

import httpx
import pytest
from pd_cluster import Cluster
from test_pd_e2e import (
    answer,
    assert_all_released,
    chat_body,
    completion_body,
    metrics,
    wait_until,
)

pytestmark = pytest.mark.slow

TIMEOUT = httpx.Timeout(120.0)
#: The prefill leg's ``kv_transfer_params`` as the sidecar writes them (connector_nixlv2.go).
PREFILL_KV = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def sidecar(prefill_url: str, decode_url: str, path: str, body: dict) -> tuple[dict, dict]:
    """Run the sidecar's two legs for ``body`` on ``path``; returns ``(prefill leg's body, decode
    leg's body)`` as sent, after asserting the prefill leg's 200 (its answer must carry
    ``kv_transfer_params``). The client's answer is then :func:`answer` of the decode leg."""
    headers = {"x-request-id": str(uuid.uuid4())}
    leg = dict(body)
    leg["kv_transfer_params"] = dict(PREFILL_KV)
    leg["stream"] = False
    leg.pop("stream_options", None)
    leg["max_tokens"] = 1
    r = httpx.post(prefill_url + path, json=leg, headers=headers, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    prefill_answer = r.json()
    assert "kv_transfer_params" in prefill_answer, prefill_answer
    decode = dict(leg)
    for field in ("stream", "stream_options", "max_tokens"):
        decode.pop(field, None)
        if field in body:
            decode[field] = body[field]
    decode["kv_transfer_params"] = prefill_answer["kv_transfer_params"]
    return leg, decode


@pytest.fixture(scope="module")
def pd_nodes(tmp_path_factory):
    with Cluster(tmp_path_factory.mktemp("llmd")) as cluster:
        tcp = ["--cache-transfer-protocol", "tcp"]
        prefill = cluster.start_server(["--splitwise-role", "prefill", *tcp], name="prefill")
        decode = cluster.start_server(["--splitwise-role", "decode", *tcp], name="decode")
        cluster.wait_healthy(prefill, decode)
        yield prefill, decode


CASES = [
    ("/v1/chat/completions", chat_body(5, False)),
    ("/v1/chat/completions", chat_body(200, True)),
    ("/v1/completions", completion_body(300, False)),
    ("/v1/completions", completion_body(40, True)),
    # A client that sends no max_tokens: the decode leg must not inherit the prefill leg's 1.
    ("/v1/completions", {"prompt": "The capital of France is", "temperature": 0, "stream": False}),
]


@pytest.mark.parametrize(
    "path, body", CASES, ids=["chat", "chat_sse", "completion", "completion_sse", "no_max_tokens"]
)
def test_llmd_sidecar_flow_equals_a_single_node(pd_nodes, path, body):
    prefill, decode = pd_nodes
    plain = dict(body, stream=False)
    plain.pop("stream_options", None)
    want = answer(prefill.url, path, plain)
    transfers = metrics(decode.url)["fastdeploy:kv_transfers_total"]
    leg, decode_body = sidecar(prefill.url, decode.url, path, body)
    assert leg["max_tokens"] == 1 and leg["stream"] is False and "stream_options" not in leg
    assert ("max_tokens" in decode_body) == ("max_tokens" in body)
    got = answer(decode.url, path, decode_body)
    assert got[0] == want[0], (path, got, want)
    assert got[1]["prompt_tokens"] == want[1]["prompt_tokens"]
    assert got[1]["completion_tokens"] == want[1]["completion_tokens"] > 1
    # The decode node pulled the prompt's KV from the prefill node (it did not prefill again).
    assert metrics(decode.url)["fastdeploy:kv_transfers_total"] == transfers + 1
    wait_until(lambda: assert_all_released(prefill.url, decode.url), 10)
