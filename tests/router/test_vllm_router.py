"""``vllm-router`` (the vLLM project's Rust router, PyPI ``vllm-router``) in front of our servers.

* fast: what it sends to a backend, captured by fake servers, validates against our request
  models, in plain mode and in both legs of its PD mode;
* slow: plain mode in front of two mixed servers answers what a server answers directly, and PD
  mode in front of a prefill and a decode node answers what a mixed server answers (greedy; chat
  and completions, streamed and not).

The router is not a dependency: the module is skipped unless it is found, as ``$VLLM_ROUTER`` (a
path to its launcher), ``vllm-router`` on ``PATH``, or the importable ``vllm_router`` module. It
is not installed here: its wheel is 24 MB from PyPI plus six packages (``aiohttp``,
``setproctitle`` ...) that the project does not use, which is neither fast nor offline-safe. To
run these tests::

    python3 -m venv /tmp/vrvenv && /tmp/vrvenv/bin/pip install vllm-router
    VLLM_ROUTER=/tmp/vrvenv/bin/vllm-router pytest tests/router/test_vllm_router.py

Its command lines (``vllm-router --help``, 0.1.17)::

    vllm-router --host H --port P --worker-urls URL1 URL2 --policy round_robin
    vllm-router --host H --port P --vllm-pd-disaggregation --prefill URL --decode URL \\
        --policy round_robin

It waits until every worker's ``/health`` answers before it listens; ``--worker-startup-check-
interval 1`` makes it look every second instead of 30. It serves Prometheus metrics on port 29000
unless ``--prometheus-port`` says otherwise.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from router_utils import fake_server, free_port, serve

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "splitwise"))
from pd_cluster import Cluster, Proc  # noqa: E402

from fastdeploy.entrypoints.openai.protocol import (  # noqa: E402
    ChatCompletionRequest,
    CompletionRequest,
)
from fastdeploy.splitwise.pd_auth import PDAuth  # noqa: E402


def vllm_router_command() -> list[str] | None:
    """The argv prefix that launches vllm-router here, or None."""
    if os.environ.get("VLLM_ROUTER"):
        return [os.environ["VLLM_ROUTER"]]
    if shutil.which("vllm-router"):
        return [shutil.which("vllm-router")]
    if importlib.util.find_spec("vllm_router") is not None:
        return [sys.executable, "-m", "vllm_router.launch_router"]
    return None


VLLM_ROUTER = vllm_router_command()
pytestmark = pytest.mark.skipif(
    VLLM_ROUTER is None,
    reason="vllm-router not found: set VLLM_ROUTER to its launcher, put it on PATH, or pip "
    "install vllm-router (see this module's docstring)",
)
MODEL = "SmolLM2-135M-Instruct"
CHAT = {"messages": [{"role": "user", "content": "What is the capital of France?"}]}
COMPLETION = {"prompt": "The capital of France is"}
PATHS = {"chat": ("/v1/chat/completions", CHAT), "completions": ("/v1/completions", COMPLETION)}
MODELS = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest}


def start_vllm_router(cluster: Cluster, name: str, mode_args: list[str]) -> Proc:
    port = free_port()
    argv = [*VLLM_ROUTER, "--host", "127.0.0.1", "--port", str(port), *mode_args]
    argv += ["--policy", "round_robin", "--worker-startup-check-interval", "1"]
    argv += ["--prometheus-port", str(free_port()), "--log-level", "warning"]
    return cluster.start(name, argv, f"http://127.0.0.1:{port}")


def plain_args(*urls: str) -> list[str]:
    return ["--worker-urls", *urls]


def pd_args(prefill: str, decode: str) -> list[str]:
    return ["--vllm-pd-disaggregation", "--prefill", prefill, "--decode", decode]


# ---------------------------------------------------------------- what reaches a backend (fast)
#: A prefill node's KV reference, signed with a PD secret (floats and nesting included): the
#: decode node must be able to verify it after vllm-router passed it along.
SECRET = b"pd-secret-for-vllm-router-tests!"
KV = PDAuth(SECRET).sign_reference(
    {
        "remote_engine_id": "p0",
        "remote_request_id": "p-1",
        "remote_block_ids": [3, 4],
        "lease_s": 30.0,
        "first_token_logprobs": [{"token_id": 7, "logprob": -0.1234567891, "top_logprobs": []}],
        "layout": {"model": "m\u00e9", "dtype": "float32"},
    }
)


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_what_vllm_router_sends_validates(tmp_path, path, stream):
    body = {**PATHS["chat" if "chat" in path else "completions"][1], "model": "m"}
    body.update(max_tokens=8, temperature=0, stream=stream)
    if stream:
        body["stream_options"] = {"include_usage": True}
    plain_app, prefill_app, decode_app = fake_server("b"), fake_server("p", KV), fake_server("d")
    with (
        serve(plain_app) as plain_url,
        serve(prefill_app) as prefill_url,
        serve(decode_app) as decode_url,
        Cluster(tmp_path) as cluster,
    ):
        plain = start_vllm_router(cluster, "vllm-router-plain", plain_args(plain_url))
        pd = start_vllm_router(cluster, "vllm-router-pd", pd_args(prefill_url, decode_url))
        cluster.wait_healthy(plain, pd, timeout=60)
        for router in (plain, pd):
            r = httpx.post(router.url + path, json=body, timeout=30)
            assert r.status_code == 200, r.text
    model = MODELS[path]
    [(_, _, sent)] = plain_app.state.seen
    model.model_validate(sent)
    [(_, p_headers, p_body)] = [s for s in prefill_app.state.seen if s[0] == path]
    [(_, _, d_body)] = [s for s in decode_app.state.seen if s[0] == path]
    model.model_validate(p_body)
    model.model_validate(d_body)
    # The prefill leg (vLLM's protocol): one token, not streamed, do_remote_decode.
    assert p_body["max_tokens"] == 1 and p_body["min_tokens"] == 1 and p_body["stream"] is False
    assert "stream_options" not in p_body  # which we refuse without stream=true
    assert p_body["kv_transfer_params"] == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    assert p_headers["x-request-id"].startswith("___prefill_addr_127.0.0.1:")
    # The decode leg: the client's body and the prefill node's answer, untouched.
    assert d_body["max_tokens"] == 8 and d_body["kv_transfer_params"] == KV
    PDAuth(SECRET).verify_reference(d_body["kv_transfer_params"])  # the signature survived
    assert {k: v for k, v in d_body.items() if k != "kv_transfer_params"} == sent
    print(f"\nprefill leg of {path}: {json.dumps(p_body)}")


# ---------------------------------------------------------------- real servers (slow)
@dataclass
class Deployment:
    """Two mixed servers, a prefill and a decode node, and vllm-router in front of each pair."""

    cluster: Cluster
    mixed: list[Proc]
    prefill: Proc
    decode: Proc
    plain_router: Proc
    pd_router: Proc


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    """Every process started at once (the model loads in parallel); each test waits for the part
    it needs."""
    with Cluster(tmp_path_factory.mktemp("vllm_router")) as c:
        mixed = [c.start_server(name=f"mixed-{i}") for i in "ab"]
        tcp = ["--cache-transfer-protocol", "tcp"]
        prefill = c.start_server(["--splitwise-role", "prefill", *tcp], name="prefill")
        decode = c.start_server(["--splitwise-role", "decode", *tcp], name="decode")
        plain = start_vllm_router(c, "vllm-router-plain", plain_args(*(m.url for m in mixed)))
        pd = start_vllm_router(c, "vllm-router-pd", pd_args(prefill.url, decode.url))
        yield Deployment(c, mixed, prefill, decode, plain, pd)


@pytest.fixture(scope="module")
def plain(deployment: Deployment) -> Deployment:
    deployment.cluster.wait_healthy(*deployment.mixed, deployment.plain_router)
    return deployment


@pytest.fixture(scope="module")
def pd(plain: Deployment) -> Deployment:
    """The PD pair, healthy; skipped when a role is refused at start-up."""
    try:
        plain.cluster.wait_healthy(plain.prefill, plain.decode)
    except AssertionError as e:
        refused = [x for x in str(e).splitlines() if "not supported yet" in x]
        if refused and "exited" in str(e):
            pytest.skip(f"needs PD roles: {refused[0].strip()}")
        raise
    plain.cluster.wait_healthy(plain.pd_router, timeout=60)
    return plain


def greedy(url: str, kind: str, stream: bool) -> str:
    """The text of a greedy 8-token request (streamed chunks joined)."""
    path, body = PATHS[kind]
    body = {**body, "model": MODEL, "temperature": 0, "max_tokens": 8, "stream": stream}
    if not stream:
        r = httpx.post(url + path, json=body, timeout=60)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice["message"]["content"] if kind == "chat" else choice["text"]
    pieces = []
    with httpx.stream("POST", url + path, json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:])["choices"]:
                pieces.append(choice["delta"].get("content") if kind == "chat" else choice["text"])
    return "".join(p for p in pieces if p)


@pytest.mark.slow
def test_plain_mode_answers_as_a_server_does(plain):
    want = greedy(plain.mixed[0].url, "chat", False)
    assert want
    # Round robin: two requests reach both servers.
    assert [greedy(plain.plain_router.url, "chat", False) for _ in range(2)] == [want, want]
    assert greedy(plain.plain_router.url, "completions", True) == greedy(
        plain.mixed[1].url, "completions", True
    )


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("kind", ["chat", "completions"])
def test_pd_mode_answers_as_a_mixed_server_does(pd, kind, stream):
    want = greedy(pd.mixed[0].url, kind, stream)
    assert want
    assert greedy(pd.pd_router.url, kind, stream) == want


# The model's greedy first token after this prompt is eos: a mixed server answers "" (stop).
EOS_FIRST = {
    "prompt": "<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n"
    "Hello! How can I help you today?",
    "model": MODEL,
    "temperature": 0,
    "max_tokens": 4,
}


@pytest.mark.slow
def test_pd_mode_greedy_eos_as_first_token(pd):
    """vllm-router's prefill leg carries min_tokens=1; the prefill node samples the first token
    without it, so an eos first token still ends the request as on a mixed server."""
    want = httpx.post(pd.mixed[0].url + "/v1/completions", json=EOS_FIRST, timeout=60).json()
    assert want["choices"][0]["text"] == "" and want["choices"][0]["finish_reason"] == "stop"
    got = httpx.post(pd.pd_router.url + "/v1/completions", json=EOS_FIRST, timeout=60).json()
    assert got["choices"] == want["choices"]
