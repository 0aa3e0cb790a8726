"""PD disaggregation end to end on CPU: ``fastdeploy router`` in front of a prefill and a decode
server, as separate processes on loopback with the default model, over ``tcp`` and (when it
imports) ``nixl``. Greedy output equals a mixed server's token for token, for chat and
completions, streamed and not, for prompts of 10 to 1,500 tokens; afterwards no pending send is
left and every block is free or cached (slow: loads the default model several times)."""

from __future__ import annotations

import importlib.util
import json

import httpx
import pytest
from pd_cluster import Cluster

pytestmark = pytest.mark.slow

PROTOCOLS = ["tcp"] + (["nixl"] if importlib.util.find_spec("nixl") is not None else [])
TIMEOUT = httpx.Timeout(120.0)


def metrics(url: str) -> dict[str, float]:
    """``/metrics`` as ``{"name{labels}": value}`` (fastdeploy series only)."""
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("fastdeploy:"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def completion_prompt(n: int) -> list[int]:
    """A prompt of exactly ``n`` token ids (ordinary vocabulary ids, not special tokens)."""
    return [(1000 + 37 * i) % 40000 + 200 for i in range(n)]


def chat_body(words: int, stream: bool) -> dict:
    text = " ".join(f"item{i}" for i in range(words))
    return {
        "messages": [{"role": "user", "content": f"Repeat the last item of: {text}"}],
        "temperature": 0,
        "max_tokens": 12,
        "stream": stream,
        **({"stream_options": {"include_usage": True}} if stream else {}),
    }


def completion_body(n: int, stream: bool) -> dict:
    return {
        "prompt": completion_prompt(n),
        "temperature": 0,
        "max_tokens": 12,
        "stream": stream,
        **({"stream_options": {"include_usage": True}} if stream else {}),
    }


def answer(url: str, path: str, body: dict) -> tuple[str, dict]:
    """(text, usage) of a chat or completion answer, streamed or not."""
    kind = "chat" if "messages" in body else "completion"
    if not body["stream"]:
        r = httpx.post(url + path, json=body, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        data = r.json()
        choice = data["choices"][0]
        return (choice["message"]["content"] if kind == "chat" else choice["text"]), data["usage"]
    text, usage = "", None
    with httpx.stream("POST", url + path, json=body, timeout=TIMEOUT) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            if event.get("usage"):
                usage = event["usage"]
            for choice in event["choices"]:
                text += (choice["delta"].get("content") or "") if kind == "chat" else choice["text"]
    return text, usage


def assert_all_released(*urls: str) -> None:
    for url in urls:
        m = metrics(url)
        assert m["fastdeploy:num_requests_running"] == 0, url
        assert m["fastdeploy:num_free_kv_blocks"] == m["fastdeploy:num_total_kv_blocks"], url
        assert m.get("fastdeploy:pd_pending_send_blocks", 0) == 0, url


@pytest.fixture(scope="module", params=PROTOCOLS)
def pd_cluster(request, tmp_path_factory):
    protocol = request.param
    with Cluster(tmp_path_factory.mktemp(f"pd_{protocol}")) as cluster:
        common = ["--cache-transfer-protocol", protocol]
        mixed = cluster.start_server(name="mixed")
        prefill = cluster.start_server(["--splitwise-role", "prefill", *common], name="prefill")
        decode = cluster.start_server(["--splitwise-role", "decode", *common], name="decode")
        cluster.wait_healthy(mixed, prefill, decode)
        router = cluster.start_router(
            ["--prefill", prefill.url, "--decode", decode.url], name="router"
        )
        cluster.wait_healthy(router)
        yield protocol, mixed, prefill, decode, router


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_pd_equals_mixed(pd_cluster, stream):
    protocol, mixed, prefill, decode, router = pd_cluster
    cases = [("/v1/completions", completion_body(n, stream)) for n in (10, 300, 1500)]
    cases += [("/v1/chat/completions", chat_body(w, stream)) for w in (3, 400)]
    for path, body in cases:
        want = answer(mixed.url, path, body)
        got = answer(router.url, path, body)
        assert got == want, f"{protocol} {path} stream={stream}"
        assert got[1]["completion_tokens"] == 12
    p = metrics(prefill.url)
    d = metrics(decode.url)
    assert p['fastdeploy:pd_pending_sends_released_total{reason="done"}'] >= len(cases)
    assert d["fastdeploy:kv_transfers_total"] >= 1
    assert d["fastdeploy:kv_transfer_bytes_total"] > 0
    assert_all_released(prefill.url, decode.url)


def test_client_disconnect_mid_stream_frees_everything(pd_cluster):
    _, _, prefill, decode, router = pd_cluster
    body = completion_body(200, True) | {"max_tokens": 400}
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=TIMEOUT) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
    wait_until(lambda: assert_all_released(prefill.url, decode.url), 20)


def test_bad_kv_transfer_params_are_400(pd_cluster):
    _, mixed, prefill, decode, _ = pd_cluster
    body = completion_body(10, False) | {"kv_transfer_params": {"do_remote_decode": True}}
    r = httpx.post(decode.url + "/v1/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 400 and "do_remote_decode" in r.text
    r = httpx.post(mixed.url + "/v1/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 400 and "mixed node" in r.text
    r = httpx.post(prefill.url + "/v1/completions", json=body | {"stream": True}, timeout=TIMEOUT)
    assert r.status_code == 400 and "stream" in r.text
    leg = httpx.post(prefill.url + "/v1/completions", json=body, timeout=TIMEOUT).json()
    params = leg["kv_transfer_params"]
    wrong = params | {"layout": params["layout"] | {"num_layers": 1}}
    r = httpx.post(
        decode.url + "/v1/completions",
        json=completion_body(10, False) | {"kv_transfer_params": wrong},
        timeout=TIMEOUT,
    )
    assert r.status_code == 400 and "num_layers" in r.text
    # The refusal released the prefill node's blocks at once (the lease is 30 s).
    wait_until(lambda: assert_all_released(prefill.url, decode.url), 5)
    other = completion_body(10, False) | {"prompt": completion_prompt(11)[1:]}
    r = httpx.post(
        decode.url + "/v1/completions", json=other | {"kv_transfer_params": params}, timeout=TIMEOUT
    )
    assert r.status_code == 400 and "belongs to another prompt" in r.text
    leg = httpx.post(prefill.url + "/v1/completions", json=body, timeout=TIMEOUT).json()
    params = leg["kv_transfer_params"]
    # A client that points the decode node elsewhere (SSRF, prefix-cache poisoning): refused
    # before any connection; without a PD secret or --pd-allowed-prefill, loopback peers only.
    redirected = params | {"remote_host": "169.254.169.254", "remote_port": 80}
    r = httpx.post(
        decode.url + "/v1/completions",
        json=completion_body(10, False) | {"kv_transfer_params": redirected},
        timeout=TIMEOUT,
    )
    assert r.status_code == 400, r.text
    assert "remote_host='169.254.169.254' is not allowed" in r.json()["error"]["message"]
    for node in (prefill, decode):  # no PD secret here: each said so at start
        assert "PD is unauthenticated" in node.log_tail(1_000_000)
    r = httpx.post(  # the real params: the decode leg runs and releases the blocks
        decode.url + "/v1/completions",
        json=completion_body(10, False) | {"kv_transfer_params": params},
        timeout=TIMEOUT,
    )
    assert r.status_code == 200, r.text
    wait_until(lambda: assert_all_released(prefill.url, decode.url), 10)


def wait_until(check, timeout_s: float) -> None:
    """Retry ``check`` (which asserts) until it passes or ``timeout_s`` ends."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            check()
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
