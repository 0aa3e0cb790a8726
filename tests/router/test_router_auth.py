"""``fastdeploy router --api-key`` (its own clients' key) and ``--backend-api-key`` (the key it
sends to its backends), in plain and PD mode, against fake backends that require the key with the
server's own middleware (:class:`~fastdeploy.entrypoints.openai.auth.APIKeyMiddleware`)."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from router_utils import fake_server, serve

from fastdeploy.entrypoints.openai.auth import APIKeyMiddleware
from fastdeploy.router.app import build_router_app
from fastdeploy.router.cli import config_from_args, make_router_parser
from fastdeploy.router.config import RouterConfig
from fastdeploy.splitwise.side_channel import SideChannelServer

BODY = {"model": "m", "prompt": "hi", "max_tokens": 8, "temperature": 0}
CLIENT_KEY, BACKEND_KEY = "client-key-1", "backend-key-2"


def guarded(app, key: str = BACKEND_KEY):
    """``app`` behind the server's --api-key middleware, recording the Authorization header of
    every request that reaches it (GETs and health polls too) in ``app.state.auth``."""
    app.state.auth = []
    app.add_middleware(APIKeyMiddleware, keys=[key], on_refused=lambda _: None)

    class Record:
        def __init__(self, inner):
            self.inner = inner

        async def __call__(self, scope, receive, send):
            if scope["type"] == "http":
                headers = dict(scope["headers"])
                app.state.auth.append((scope["path"], headers.get(b"authorization")))
            await self.inner(scope, receive, send)

    app.add_middleware(Record)
    return app


def router(**config):
    config.setdefault("health_interval_s", 0.2)
    return serve(build_router_app(RouterConfig(**config)))


def outcome(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "fastdeploy:router_requests_total" and s.labels["outcome"] == name:
                return s.value
    return 0.0


def test_plain_mode_needs_the_client_key_and_sends_the_backend_key():
    b = guarded(fake_server("backend"))
    with serve(b) as ub:
        keys = {"api_key": [CLIENT_KEY], "backend_api_key": BACKEND_KEY}
        with router(backend=[ub], **keys) as url:
            r = httpx.post(url + "/v1/completions", json=BODY, timeout=10)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            wrong = {"Authorization": f"Bearer {BACKEND_KEY}"}
            r = httpx.post(url + "/v1/completions", json=BODY, headers=wrong, timeout=10)
            assert r.status_code == 401
            assert not b.state.seen  # nothing reached the backend
            assert outcome(url, "unauthorized") == 2
            good = {"Authorization": f"Bearer {CLIENT_KEY}"}
            r = httpx.post(url + "/v1/completions", json=BODY, headers=good, timeout=10)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "backend"
            r = httpx.get(url + "/v1/models", headers=good, timeout=10)
            assert r.status_code == 200 and r.json()["data"][0]["id"] == "backend"
            assert httpx.get(url + "/health").status_code == 200  # open
            assert httpx.get(url + "/metrics").status_code == 200  # open
        paths = {path for path, _ in b.state.auth}
        assert {"/health", "/v1/models", "/v1/completions"} <= paths
        # Every request the router made carried the backend's key, never the client's.
        assert {auth for _, auth in b.state.auth} == {f"Bearer {BACKEND_KEY}".encode()}


def test_pd_mode_sends_the_backend_key_on_both_legs():
    side = SideChannelServer("127.0.0.1", 0, lambda op, m: {}).start()
    kv = {
        "remote_engine_id": "p0",
        "remote_request_id": "p-req-1",
        "remote_host": "127.0.0.1",
        "remote_port": side.port,
        "remote_block_ids": [3, 4],
        "first_token_id": 42,
    }
    p = guarded(fake_server("prefill", kv_params=kv))
    d = guarded(fake_server("decode"))
    keys = {"api_key": [CLIENT_KEY], "backend_api_key": BACKEND_KEY}
    try:
        with serve(p) as up, serve(d) as ud, router(prefill=[up], decode=[ud], **keys) as url:
            assert httpx.post(url + "/v1/completions", json=BODY, timeout=10).status_code == 401
            good = {"Authorization": f"Bearer {CLIENT_KEY}"}
            r = httpx.post(url + "/v1/completions", json=BODY, headers=good, timeout=10)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "decode"
            assert len(p.state.seen) == len(d.state.seen) == 1
    finally:
        side.close()
    for app in (p, d):
        assert "/v1/completions" in {path for path, _ in app.state.auth}
        assert {auth for _, auth in app.state.auth} == {f"Bearer {BACKEND_KEY}".encode()}


def test_without_the_backend_key_a_guarded_backend_answers_401_through_the_router():
    b = guarded(fake_server("backend"))
    with serve(b) as ub, router(backend=[ub]) as url:
        r = httpx.post(url + "/v1/completions", json=BODY, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert {auth for _, auth in b.state.auth} == {None}


def test_flags_and_environment(monkeypatch):
    monkeypatch.delenv("FD_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    monkeypatch.delenv("FD_BACKEND_API_KEY", raising=False)
    parse = make_router_parser().parse_args
    config = config_from_args(parse(["--backend", "http://a:1"]))
    assert (config.api_key, config.backend_api_key) == ([], None)
    args = ["--backend", "http://a:1", "--api-key", "c1", "c2", "--backend-api-key", "b1"]
    config = config_from_args(parse(args))
    assert (config.api_key, config.backend_api_key) == (["c1", "c2"], "b1")
    assert "c1" not in repr(config) and "b1" not in repr(config)
    monkeypatch.setenv("VLLM_API_KEY", "cv")
    monkeypatch.setenv("FD_BACKEND_API_KEY", "be")
    config = config_from_args(parse(["--backend", "http://a:1"]))
    assert (config.api_key, config.backend_api_key) == (["cv"], "be")
    with pytest.raises(ValueError, match=r"^--backend-api-key is invalid \(not shown\)"):
        config_from_args(parse(["--backend", "http://a:1", "--backend-api-key", "a b"]))
