"""``fastdeploy router`` in front of fake servers: the PD legs as vLLM's protocol has them, plain
replicas, retries, ABORT on a failed decode leg, health, request ids, and config errors."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from router_utils import dying_stream_server, fake_server, free_port, serve, stalling_server

from fastdeploy.router.app import build_router_app
from fastdeploy.router.config import RouterConfig
from fastdeploy.router.endpoints import EndpointPool, NoHealthyBackendError
from fastdeploy.splitwise.side_channel import SideChannelServer

BODY = {"model": "m", "prompt": "hi", "max_tokens": 8, "temperature": 0}


def metric(url: str, name: str, **labels) -> float:
    text = httpx.get(url + "/metrics").text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def kv_params(side_port: int) -> dict:
    return {
        "remote_engine_id": "p0",
        "remote_request_id": "p-req-1",
        "remote_host": "127.0.0.1",
        "remote_port": side_port,
        "remote_block_ids": [3, 4],
        "first_token_id": 42,
    }


def router(**config) -> object:
    config.setdefault("health_interval_s", 0.2)
    return serve(build_router_app(RouterConfig(**config)))


# ---------------------------------------------------------------- config
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "either --prefill and --decode URLs"),
        ({"backend": ["http://a:1"], "prefill": ["http://b:1"]}, "not both"),
        ({"prefill": ["http://b:1"]}, "at least one prefill URL and one decode URL"),
        ({"backend": ["ftp://a"]}, "backend='ftp://a' is invalid; allowed: an http://"),
        ({"backend": ["http://a:1"], "policy": "random"}, "policy='random' is invalid"),
        ({"backend": ["http://a:1"], "prefill_retries": -1}, "prefill_retries=-1 is invalid"),
        (
            {"backend": ["http://a:1"], "health_failure_threshold": 0},
            "health_failure_threshold=0 is invalid",
        ),
    ],
)
def test_config_errors_name_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RouterConfig(**kwargs)


@pytest.mark.slow
def test_bad_flag_exits_2_with_one_error_line():
    out = subprocess.run(
        [sys.executable, "-m", "fastdeploy.router", "--backend", "localhost:8000"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith("error: backend='localhost:8000'")


def test_policies():
    pool = EndpointPool("backend", ["http://a", "http://b", "http://c"], "round_robin")
    assert [pool.pick().url for _ in range(4)] == ["http://a", "http://b", "http://c", "http://a"]
    pool = EndpointPool("backend", ["http://a", "http://b"], "least_outstanding")
    first = pool.pick()
    assert pool.pick() is not first  # the first one has a request in flight
    pool.release(first)
    pool.endpoints[1].healthy = False
    assert pool.pick().url == "http://a"
    pool.endpoints[0].healthy = False
    with pytest.raises(NoHealthyBackendError, match="no healthy backend server"):
        pool.pick()


# ---------------------------------------------------------------- plain mode
def test_plain_mode_round_robin_streaming_and_request_ids():
    a, b = fake_server("alpha"), fake_server("bravo")
    with serve(a) as ua, serve(b) as ub, router(backend=[ua, ub]) as url:
        texts = [
            httpx.post(url + "/v1/completions", json=BODY, timeout=10).json()["choices"][0]["text"]
            for _ in range(4)
        ]
        assert texts == ["alpha", "bravo", "alpha", "bravo"]
        with httpx.stream(
            "POST",
            url + "/v1/chat/completions",
            json={**BODY, "stream": True},
            headers={"X-Request-Id": "client-7"},
            timeout=10,
        ) as r:
            assert r.headers["x-request-id"] == "client-7"
            assert r.headers["content-type"].startswith("text/event-stream")
            raw = b"".join(r.iter_raw())
        assert raw.endswith(b"data: [DONE]\n\n") and raw.count(b"data: ") == 3
        last = a.state.seen[-1]  # the fifth request: alpha's turn
        assert last[0] == "/v1/chat/completions" and last[1]["x-request-id"] == "client-7"
        generated = httpx.post(url + "/v1/completions", json=BODY, timeout=10)
        assert len(generated.headers["x-request-id"]) == 32  # made up when the client sent none
        assert httpx.get(url + "/v1/models").json()["data"][0]["id"] in ("alpha", "bravo")
        assert metric(url, "fastdeploy:router_requests_total", outcome="ok") == 6


def wait_for(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_one_failed_health_poll_does_not_take_a_server_out():
    """A /health that fails fewer than health_failure_threshold times in a row (a server slow
    under load) leaves the server in; the threshold-th failure takes it out."""
    a = fake_server("alpha")
    with serve(a) as ua, router(backend=[ua], health_failure_threshold=3) as url:
        a.state.healthy = False
        time.sleep(0.3)  # one or two failed polls (0.2 s apart)
        assert httpx.post(url + "/v1/completions", json=BODY).status_code == 200
        wait_for(lambda: httpx.get(url + "/health").status_code == 503)
        a.state.healthy = True
        wait_for(lambda: httpx.get(url + "/health").status_code == 200)


def test_health_polling_skips_a_down_backend_and_reports_503_when_all_are_down():
    a, b = fake_server("alpha"), fake_server("bravo")
    with (
        serve(a) as ua,
        serve(b) as ub,
        router(backend=[ua, ub], health_failure_threshold=1) as url,
    ):
        b.state.healthy = False
        time.sleep(0.6)  # three polls
        texts = {
            httpx.post(url + "/v1/completions", json=BODY).json()["choices"][0]["text"]
            for _ in range(3)
        }
        assert texts == {"alpha"}
        assert httpx.get(url + "/health").status_code == 200
        a.state.healthy = False
        time.sleep(0.6)
        health = httpx.get(url + "/health")
        assert health.status_code == 503 and health.json()["no_healthy"] == ["backend"]
        r = httpx.post(url + "/v1/completions", json=BODY)
        assert r.status_code == 503 and "no healthy backend server" in r.json()["error"]["message"]
        a.state.healthy = True
        time.sleep(0.6)
        assert httpx.post(url + "/v1/completions", json=BODY).status_code == 200


def test_bad_body_is_a_400():
    with serve(fake_server("alpha")) as ua, router(backend=[ua]) as url:
        r = httpx.post(url + "/v1/completions", content=b"{nope", timeout=10)
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


# ---------------------------------------------------------------- PD mode
def test_pd_legs_follow_kv_transfer_params():
    side = SideChannelServer("127.0.0.1", 0, lambda op, m: {}).start()
    p, d = fake_server("prefill", kv_params=kv_params(side.port)), fake_server("decode")
    try:
        with serve(p) as up, serve(d) as ud, router(prefill=[up], decode=[ud]) as url:
            body = {**BODY, "stream": True, "stream_options": {"include_usage": True}}
            with httpx.stream(
                "POST", url + "/v1/completions", json=body, headers={"X-Request-Id": "r9"}
            ) as r:
                assert r.status_code == 200 and r.headers["x-request-id"] == "r9"
                raw = b"".join(r.iter_raw())
            assert raw.endswith(b"data: [DONE]\n\n")
            (_, p_headers, p_body), (_, d_headers, d_body) = p.state.seen[0], d.state.seen[0]
            assert p_body["kv_transfer_params"] == {"do_remote_decode": True}
            assert p_body["max_tokens"] == 1 and p_body["stream"] is False
            assert "stream_options" not in p_body and p_body["prompt"] == "hi"
            assert d_body == {**body, "kv_transfer_params": kv_params(side.port)}
            assert p_headers["x-request-id"] == d_headers["x-request-id"] == "r9"
            plain = httpx.post(url + "/v1/completions", json=BODY).json()
            assert plain["choices"][0]["text"] == "decode"
    finally:
        side.close()


def test_pd_retries_the_prefill_leg_on_a_dead_node_but_never_the_decode_leg():
    side = SideChannelServer("127.0.0.1", 0, lambda op, m: {}).start()
    dead = f"http://127.0.0.1:{free_port()}"
    p, d = fake_server("prefill", kv_params=kv_params(side.port)), fake_server("decode")
    try:
        with serve(p) as up, serve(d) as ud:
            config = RouterConfig(prefill=[dead, up], decode=[ud], health_interval_s=30)
            app = build_router_app(config)
            with serve(app) as url:
                dead_endpoint = app.state.pools["prefill"].endpoints[0]
                time.sleep(0.3)  # the first health poll marks it down ...
                assert not dead_endpoint.healthy
                dead_endpoint.healthy = True  # ... a request finds out too: pretend it is up
                for _ in range(2):
                    r = httpx.post(url + "/v1/completions", json=BODY, timeout=10)
                    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "decode"
                assert metric(url, "fastdeploy:router_prefill_retries_total") == 1
                assert not dead_endpoint.healthy  # the connection error marked it down again
            dead_decode = f"http://127.0.0.1:{free_port()}"
            config = RouterConfig(
                prefill=[up], decode=[dead_decode, dead_decode], health_interval_s=30
            )
            app = build_router_app(config)
            with serve(app) as url:
                time.sleep(0.3)
                for endpoint in app.state.pools["decode"].endpoints:
                    endpoint.healthy = True
                r = httpx.post(url + "/v1/completions", json=BODY, timeout=10)
                assert r.status_code == 502 and "ConnectError" in r.json()["error"]["message"]
                assert metric(url, "fastdeploy:router_prefill_retries_total") == 0
                healthy = [e.healthy for e in app.state.pools["decode"].endpoints]
                assert healthy.count(False) == 1  # one decode node tried, the other never
    finally:
        side.close()


def test_failed_decode_leg_aborts_the_prefill_blocks():
    aborted = []
    side = SideChannelServer("127.0.0.1", 0, lambda op, m: aborted.append((op, m)) or {}).start()
    p = fake_server("prefill", kv_params=kv_params(side.port))
    d = fake_server("decode", fail_status=500)
    try:
        with serve(p) as up, serve(d) as ud, router(prefill=[up], decode=[ud]) as url:
            r = httpx.post(url + "/v1/completions", json=BODY, timeout=10)
            assert r.status_code == 500 and "decode refused" in r.text
            assert [(op, m["request_ids"]) for op, m in aborted] == [("ABORT", ["p-req-1"])]
            assert metric(url, "fastdeploy:router_prefill_aborts_total", result="sent") == 1
    finally:
        side.close()


def test_prefill_answer_without_kv_transfer_params_is_a_502_naming_the_role():
    p, d = fake_server("mixed-not-prefill"), fake_server("decode")
    with serve(p) as up, serve(d) as ud, router(prefill=[up], decode=[ud]) as url:
        r = httpx.post(url + "/v1/completions", json=BODY, timeout=10)
        assert r.status_code == 502 and "--splitwise-role prefill" in r.json()["error"]["message"]
        assert d.state.seen == []


def test_prefill_error_is_passed_to_the_client():
    p, d = fake_server("prefill", fail_status=400), fake_server("decode")
    with serve(p) as up, serve(d) as ud, router(prefill=[up], decode=[ud]) as url:
        r = httpx.post(url + "/v1/completions", json=BODY, timeout=10)
        assert r.status_code == 400 and "prefill refused" in r.json()["error"]["message"]
        assert d.state.seen == []


def test_a_backend_dying_mid_stream_ends_the_stream_with_an_error_event():
    with serve(dying_stream_server()) as ub, router(backend=[ub]) as url:
        with httpx.stream("POST", url + "/v1/completions", json={**BODY, "stream": True}) as r:
            raw = b"".join(r.iter_raw())
        assert raw.startswith(b'data: {"text": "partial"}')
        assert b"failed mid-stream" in raw and raw.endswith(b"data: [DONE]\n\n")
        assert httpx.get(url + "/health").status_code == 200


def test_a_backend_stalling_after_its_headers_is_never_a_200_nor_ok():
    """The backend sends 200 and its headers, then nothing: with ``decode_timeout_s`` 0.5 the
    router answers a non-streamed request 504 with an error body, ends a stream with an error
    event and ``[DONE]``, and counts both as errors, none as ok."""
    with serve(stalling_server()) as ub, router(backend=[ub], decode_timeout_s=0.5) as url:
        t0 = time.monotonic()
        r = httpx.post(url + "/v1/completions", json=BODY, timeout=10)
        assert time.monotonic() - t0 < 5
        assert r.status_code == 504, (r.status_code, r.text)
        message = r.json()["error"]["message"]
        assert "backend" in message and "failed mid-answer: ReadTimeout" in message
        with httpx.stream(
            "POST", url + "/v1/completions", json={**BODY, "stream": True}, timeout=10
        ) as r:
            assert r.status_code == 200  # its status went out with the first chunk
            raw = b"".join(r.iter_raw())
        assert raw.startswith(b'data: {"text": "partial"}')
        assert b"stalled mid-stream: ReadTimeout" in raw and raw.endswith(b"data: [DONE]\n\n")
        assert metric(url, "fastdeploy:router_requests_total", outcome="error") == 2
        assert metric(url, "fastdeploy:router_requests_total", outcome="ok") == 0


@pytest.mark.slow
def test_a_busy_port_is_one_error_line_and_exit_2():
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "-m", "fastdeploy.router", "--backend", "http://127.0.0.1:1",
             "--host", "127.0.0.1", "--port", str(port)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith(f"error: --port={port} on 127.0.0.1")


@pytest.mark.slow
def test_fastdeploy_router_subcommand():
    """``fastdeploy router`` is the same command as ``python -m fastdeploy.router``."""
    from fastdeploy.entrypoints.cli.main import build_parser

    args = build_parser().parse_args(
        ["router", "--prefill", "http://p:1", "--decode", "http://d:2", "--port", "9"]
    )
    assert (args.prefill, args.decode, args.port) == (["http://p:1"], ["http://d:2"], 9)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "fastdeploy.entrypoints.cli.main",
            "router",
            "--decode",
            "http://d:2",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "at least one prefill URL and one decode URL" in out.stderr.strip().splitlines()[-1]


def test_more_requests_in_flight_than_httpx_pools_by_default_all_reach_the_backend():
    """httpx caps a client at 100 connections by default; the router's client used to, so the
    101st concurrent request waited inside the router (up to the leg timeout) instead of
    reaching a backend with room. This backend answers only once 150 requests are in at once."""
    import asyncio

    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    n = 150
    backend = FastAPI()
    state = {"in": 0, "peak": 0}

    @backend.get("/health")
    async def health():
        return JSONResponse({})

    @backend.post("/v1/completions")
    async def completions():
        state["in"] += 1
        state["peak"] = max(state["peak"], state["in"])
        for _ in range(200):  # 10 s at most
            if state["peak"] >= n:
                break
            await asyncio.sleep(0.05)
        state["in"] -= 1
        return JSONResponse({"choices": [{"text": "ok"}], "peak": state["peak"]})

    async def burst(url: str) -> list[int]:
        limits = httpx.Limits(max_connections=None)
        async with httpx.AsyncClient(timeout=30, limits=limits) as client:
            answers = await asyncio.gather(
                *(client.post(url + "/v1/completions", json=BODY) for _ in range(n))
            )
        return [a.json()["peak"] for a in answers]

    with serve(backend) as ub, router(backend=[ub]) as url:
        peaks = asyncio.run(burst(url))
    assert min(peaks) == n, f"at most {max(peaks)} requests reached the backend together"


def test_a_backends_429_reaches_the_client_with_its_retry_after():
    """A server at its ``--max-concurrency`` answers 429 with ``Retry-After``; the router used
    to drop the header, so clients that back off by it (OpenAI's) could not. Plain mode, and
    the prefill leg of PD mode."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    busy = FastAPI()

    @busy.get("/health")
    async def health():
        return JSONResponse({})

    @busy.post("/v1/completions")
    async def completions():
        body = {"error": {"message": "at its limit", "type": "rate_limit_error"}}
        return JSONResponse(body, status_code=429, headers={"Retry-After": "3"})

    decode = fake_server("decode")
    with serve(busy) as ub, serve(decode) as ud:
        for config in ({"backend": [ub]}, {"prefill": [ub], "decode": [ud]}):
            with router(**config) as url:
                r = httpx.post(url + "/v1/completions", json=BODY, timeout=10)
                assert (r.status_code, r.headers.get("retry-after")) == (429, "3"), config
    assert decode.state.seen == []  # the decode leg never ran
