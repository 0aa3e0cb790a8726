"""``--api-key`` (issue 43: every route was open, ``/v1/server_info`` included, which prints the
whole config). Against the fake engine: every route but ``/health`` and ``/metrics`` needs
``Authorization: Bearer <key>`` (any of several keys), a refusal is a 401 with an OpenAI-style body
counted as ``unauthorized``, and the key is never printed. The last test runs the real server with
``--api-server-count 2`` and the key from the environment (slow)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import httpx
import pytest
from http_server_utils import fake_server, free_port, metric_samples, wait_until

from fastdeploy.entrypoints.openai.auth import bearer_matches, mask, resolve_api_keys

KEYS = ("key-one", "sk-Two_2")
UNAUTHORIZED = ("fastdeploy:request_rejected_total", (("reason", "unauthorized"),))


@pytest.fixture(scope="module")
def server():
    with fake_server(api_keys=KEYS) as running:
        yield running


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize(
    "headers, message",
    [
        ({}, "no API key was sent"),
        (bearer("key-three"), "the API key is not valid"),
        (bearer("key-on"), "the API key is not valid"),
        ({"Authorization": "Basic key-one"}, "the API key is not valid"),
        ({"Authorization": "key-one"}, "the API key is not valid"),
    ],
    ids=["none", "other", "prefix", "basic", "no_scheme"],
)
@pytest.mark.parametrize(
    "method, path",
    [
        ("GET", "/v1/models"),
        ("GET", "/v1/server_info"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/v1/no-such-route"),
        ("GET", "/openapi.json"),
    ],
)
def test_every_route_but_health_and_metrics_needs_the_key(server, method, path, headers, message):
    url, engine, _ = server
    before = metric_samples(url).get(UNAUTHORIZED, 0)
    body = {"prompt": [5, 6], "max_tokens": 2} if method == "POST" else None
    r = httpx.request(method, url + path, json=body, headers=headers, timeout=10)
    assert r.status_code == 401, r.text
    assert r.headers["www-authenticate"] == "Bearer"
    assert r.json() == {
        "error": {
            "message": f"{message}; send it as 'Authorization: Bearer <key>' (this server runs "
            "with --api-key)",
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }
    assert metric_samples(url)[UNAUTHORIZED] - before == 1
    assert not engine.requests


@pytest.mark.parametrize("key", KEYS)
def test_each_key_is_accepted_and_the_scheme_is_case_insensitive(server, key):
    url = server[0]
    assert httpx.get(url + "/v1/models", headers=bearer(key), timeout=10).status_code == 200
    r = httpx.get(url + "/v1/models", headers={"Authorization": f"bearer  {key}"}, timeout=10)
    assert r.status_code == 200
    body = {"prompt": [5, 6], "max_tokens": 2}
    r = httpx.post(url + "/v1/completions", json=body, headers=bearer(key), timeout=10)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_health_and_metrics_stay_open(server):
    url = server[0]
    assert httpx.get(url + "/health", timeout=10).json() == {"status": "ok"}
    r = httpx.get(url + "/metrics", timeout=10)
    assert r.status_code == 200 and "fastdeploy:request_rejected_total" in r.text


def test_server_info_masks_the_keys(server):
    r = httpx.get(server[0] + "/v1/server_info", headers=bearer(KEYS[0]), timeout=10)
    assert r.status_code == 200
    assert r.json()["api_key"] == "<2 keys, hidden>"
    assert not any(key in r.text for key in KEYS)


def test_an_open_server_serves_without_a_key_and_says_so():
    with fake_server() as (url, _, _):
        info = httpx.get(url + "/v1/server_info", timeout=10).json()
        assert info["api_key"] is None


def test_the_comparison_is_hmac_compare_digest_against_every_key(monkeypatch):
    """Constant time: every key is compared with hmac.compare_digest, also after a match."""
    import hmac

    calls = []

    def spy(a, b):
        calls.append((a, b))
        return a == b

    monkeypatch.setattr(hmac, "compare_digest", spy)
    keys = [b"k1", b"k2", b"k3"]
    assert bearer_matches(b"Bearer k1", keys)
    assert calls == [(b"k1", b"k1"), (b"k1", b"k2"), (b"k1", b"k3")]
    assert not bearer_matches(None, keys) and not bearer_matches(b"Bearer ", keys)


def test_keys_come_from_the_flag_then_fd_api_key_then_vllm_api_key():
    env = {"FD_API_KEY": "fd", "VLLM_API_KEY": "vllm"}
    assert resolve_api_keys(["a", "b"], env) == ["a", "b"]
    assert resolve_api_keys(None, env) == ["fd"]
    assert resolve_api_keys(None, {"VLLM_API_KEY": "vllm"}) == ["vllm"]
    assert resolve_api_keys(None, {"FD_API_KEY": "", "VLLM_API_KEY": "vllm"}) == ["vllm"]
    assert resolve_api_keys(None, {}) == []
    assert mask([]) is None and mask(["a"]) == "<1 key, hidden>"


@pytest.mark.parametrize(
    "given, env, named",
    [
        (["good", "bad key"], {}, "value 2 of --api-key"),
        ([""], {}, "--api-key"),
        (None, {"FD_API_KEY": "tab\tkey"}, "FD_API_KEY"),
        (None, {"VLLM_API_KEY": "clé"}, "VLLM_API_KEY"),
    ],
)
def test_a_bad_key_is_named_but_not_shown(given, env, named):
    with pytest.raises(ValueError) as err:
        resolve_api_keys(given, env)
    assert str(err.value) == (
        f"{named} is invalid (not shown); allowed: a non-empty key of printable ASCII without "
        "spaces"
    )


def test_print_config_masks_the_key(capsys, monkeypatch):
    from fastdeploy.entrypoints.openai.api_server import run_server
    from fastdeploy.entrypoints.server_args import make_arg_parser

    monkeypatch.setenv("VLLM_API_KEY", "secret-from-env")
    assert run_server(make_arg_parser().parse_args(["--print-config"])) == 0
    out = capsys.readouterr().out
    assert json.loads(out)["server"]["api_key"] == "<1 key, hidden>"
    assert "secret-from-env" not in out
    args = make_arg_parser().parse_args(["--print-config", "--api-key", "k-1", "k-2"])
    assert run_server(args) == 0
    out = capsys.readouterr().out
    assert json.loads(out)["server"]["api_key"] == "<2 keys, hidden>" and "k-1" not in out


@pytest.mark.slow
def test_every_api_server_process_needs_the_key(tmp_path):
    """--api-server-count 2, the key from FD_API_KEY: both processes refuse a request without
    it on a connection they serve, serve one with it, and neither logs it."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "server.log"
    args = ["--host", "127.0.0.1", "--port", str(port), "--api-server-count", "2"]
    args += ["--max-num-seqs", "4", "--max-model-len", "256", "--timeout-graceful-shutdown", "2"]
    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir()
    env = {**os.environ, "FD_API_KEY": "k-env-123", "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)}
    env.pop("VLLM_API_KEY", None)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fastdeploy.entrypoints.openai.api_server", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )
    try:

        def ready() -> bool:
            text = log_path.read_text(errors="replace")
            if proc.poll() is not None:
                raise AssertionError(f"server exited with {proc.returncode}:\n{text}")
            return text.count("Application startup complete") == 2

        wait_until(ready, 300, "both API server processes")
        seen = set()
        for _ in range(200):
            with httpx.Client(base_url=url, timeout=60) as client:
                info = client.get("/v1/server_info", headers=bearer("k-env-123")).json()
                index = info["api_server"]["index"]
                if index in seen:
                    continue
                seen.add(index)
                assert info["api_key"] == "<1 key, hidden>"
                # The same connection, so the same process, without the key:
                r = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
                assert client.get("/health").status_code == 200
                body = {"prompt": "Hi", "max_tokens": 2}
                r = client.post("/v1/completions", json=body, headers=bearer("k-env-123"))
                assert r.status_code == 200, r.text
            if seen == {0, 1}:
                break
        assert seen == {0, 1}
        unauthorized = metric_samples(url)[UNAUTHORIZED]
        assert unauthorized == 2  # one per process, summed over both
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
    assert "k-env-123" not in log_path.read_text(errors="replace")
