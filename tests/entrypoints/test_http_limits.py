"""The request limits of ``fastdeploy serve`` (issue 43: 10,000 headers, a 1 MB header, and a
``Content-Length`` of 999,999,999 with 13 bytes sent were all accepted), against the fake engine,
with both of uvicorn's HTTP parsers (httptools, which the server uses when it is installed, and
h11). Each refusal is answered (431, 413, 408) and counted under its reason in
``fastdeploy:request_rejected_total``, and the server serves on."""

from __future__ import annotations

import json
import select
import socket
import time

import httpx
import pytest
from http_server_utils import fake_server, metric_samples

from fastdeploy.entrypoints.openai.limits import HTTPLimits

READ_TIMEOUT_S = 1.0
MAX_BODY = 256 * 1024
LIMITS = HTTPLimits(max_body_bytes=MAX_BODY, read_timeout_s=READ_TIMEOUT_S)


@pytest.fixture(scope="module", params=["httptools", "h11"])
def server(request):
    with fake_server(limits=LIMITS, http=request.param) as running:
        yield running[0]


def rejected(url: str, reason: str) -> float:
    return metric_samples(url).get(("fastdeploy:request_rejected_total", (("reason", reason),)), 0)


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    return sock


def read_response(sock: socket.socket) -> tuple[int, dict, bool]:
    """``(status, JSON body, closed by the server)`` of the one response on ``sock``."""
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body), True


def send_until_answered(sock: socket.socket, data: bytes, chunk: int = 16 * 1024) -> None:
    """Send ``data`` in chunks, stopping as soon as the server has answered (it refuses a head
    before the client has sent all of it; sending on would be answered with a reset)."""
    for i in range(0, len(data), chunk):
        try:
            sock.sendall(data[i : i + chunk])
        except (BrokenPipeError, ConnectionResetError):
            return
        if select.select([sock], [], [], 0.05)[0]:
            return


def test_the_defaults_are_the_documented_ones():
    limits = HTTPLimits()
    assert (limits.max_header_count, limits.max_header_bytes) == (256, 65536)
    assert (limits.max_body_bytes, limits.read_timeout_s) == (16 * 1024 * 1024, 60.0)
    with pytest.raises(
        ValueError, match=r"max_header_count=0 is invalid; allowed: an integer >= 1"
    ):
        HTTPLimits(max_header_count=0)


def test_a_1_mb_header_is_refused_with_431_and_counted(server):
    before = rejected(server, "header_size")
    sock = connect(server)
    with sock:
        head = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 1_000_000 + b"\r\n\r\n"
        send_until_answered(sock, head)
        status, body, closed = read_response(sock)
    assert status == 431
    assert body["error"]["code"] == "request_header_fields_too_large"
    assert "larger than 65536 bytes" in body["error"]["message"]
    assert rejected(server, "header_size") - before == 1
    assert httpx.get(server + "/health", timeout=5).status_code == 200


def test_a_100_kb_header_sent_at_once_is_refused_too(server):
    """A head that arrives whole in one read passes both parsers' own checks; it is measured
    again before the app runs."""
    before = rejected(server, "header_size")
    sock = connect(server)
    with sock:
        head = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n"
        send_until_answered(sock, head, chunk=len(head))
        status, body, _ = read_response(sock)
    assert status == 431
    assert "65536 bytes" in body["error"]["message"]
    assert rejected(server, "header_size") - before == 1


def test_10000_headers_are_refused_with_431_and_counted(server):
    before = rejected(server, "header_size") + rejected(server, "header_count")
    sock = connect(server)
    with sock:
        lines = b"".join(b"X-H%d: v\r\n" % i for i in range(10_000))
        send_until_answered(sock, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + lines + b"\r\n")
        status, _, _ = read_response(sock)
    assert status == 431
    # 10,000 such lines are 118 KB: the header block's size refuses them first.
    assert rejected(server, "header_size") + rejected(server, "header_count") - before == 1


def test_more_headers_than_the_count_limit_is_431_naming_both_numbers(server):
    before = rejected(server, "header_count")
    headers = {f"x-h{i}": "v" for i in range(300)}
    r = httpx.get(server + "/v1/models", headers=headers, timeout=10)
    assert r.status_code == 431, r.text
    message = r.json()["error"]["message"]
    assert message.startswith("the request has 30") and "allowed: at most 256" in message
    assert rejected(server, "header_count") - before == 1
    headers = {f"x-h{i}": "v" for i in range(200)}  # under the limit: served
    assert httpx.get(server + "/v1/models", headers=headers, timeout=10).status_code == 200


def test_content_length_999999999_with_13_bytes_is_refused_at_once(server):
    """The issue's probe: refused from the header alone (413), not waited on."""
    before = rejected(server, "body_size")
    sock = connect(server)
    with sock:
        t0 = time.monotonic()
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 999999999\r\n\r\n" + b'{"prompt": 1}'
        )
        status, body, _ = read_response(sock)
        elapsed = time.monotonic() - t0
    assert status == 413
    assert body["error"]["message"] == (
        f"the request body (Content-Length: 999999999) is larger than {MAX_BODY} bytes; "
        f"allowed: at most {MAX_BODY} bytes (--max-request-body-bytes)"
    )
    assert elapsed < READ_TIMEOUT_S
    assert rejected(server, "body_size") - before == 1


def test_a_short_body_times_out_with_408_and_the_connection_is_closed(server):
    before = rejected(server, "read_timeout")
    sock = connect(server)
    with sock:
        t0 = time.monotonic()
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n" + b'{"prompt": 1}'
        )
        status, body, closed = read_response(sock)  # returns only once the server closed
        elapsed = time.monotonic() - t0
    assert status == 408 and closed
    assert body["error"]["message"] == (
        "the request body did not arrive within 1 s (13 bytes received) (--request-read-timeout)"
    )
    assert READ_TIMEOUT_S <= elapsed < READ_TIMEOUT_S + 3
    assert rejected(server, "read_timeout") - before == 1


@pytest.mark.parametrize("sent", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"])
def test_headers_that_never_end_time_out_with_408(server, sent):
    """Slowloris: a connection that sends nothing, or a head without its end, is answered and
    closed after the read timeout."""
    before = rejected(server, "read_timeout")
    sock = connect(server)
    with sock:
        t0 = time.monotonic()
        sock.sendall(sent)
        status, body, _ = read_response(sock)
        elapsed = time.monotonic() - t0
    assert status == 408
    assert body["error"]["message"].startswith("the request's headers did not arrive within 1 s")
    assert READ_TIMEOUT_S - 0.1 <= elapsed < READ_TIMEOUT_S + 3
    assert rejected(server, "read_timeout") - before == 1


def test_a_chunked_body_over_the_limit_is_413(server):
    before = rejected(server, "body_size")

    def chunks():
        for _ in range(40):
            yield b"x" * 16 * 1024

    r = httpx.post(server + "/v1/completions", content=chunks(), timeout=10)
    assert r.status_code == 413
    assert "at least" in r.json()["error"]["message"]
    assert rejected(server, "body_size") - before == 1


def test_large_bodies_and_many_requests_on_one_connection_are_not_head_bytes(server):
    """Only a request's head counts against the header limit: a 200 KB body is read (and
    answered by the prompt's own rule), and 40 requests with 4 KB of headers each on one
    keep-alive connection (160 KB in all) are served."""
    before = rejected(server, "header_size")
    r = httpx.post(server + "/v1/completions", json={"prompt": "x" * 200_000}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    with httpx.Client(base_url=server, timeout=10) as client:
        for _ in range(40):
            r = client.get("/v1/models", headers={"x-pad": "p" * 4096})
            assert r.status_code == 200
    body = {"prompt": [5, 6], "max_tokens": 2}
    assert httpx.post(server + "/v1/completions", json=body, timeout=10).status_code == 200
    assert rejected(server, "header_size") == before


def test_the_flags_set_the_limits_and_print_config_shows_them():
    """Each flag is a knob that acts: parsed into the limits the server runs with, shown by
    --print-config, and a bad value names its flag."""
    from fastdeploy.entrypoints.server_args import make_arg_parser, request_limits

    args = make_arg_parser().parse_args(
        ["--h11-max-header-count", "10", "--h11-max-incomplete-event-size", "2048"]
        + ["--max-request-body-bytes", "4096", "--request-read-timeout", "2.5"]
        + ["--max-stop-strings", "2", "--max-stop-chars", "8", "--max-stop-token-ids", "3"]
    )
    http, stop = request_limits(args)
    assert http == HTTPLimits(10, 2048, 4096, 2.5)
    assert (stop.max_stop_strings, stop.max_stop_chars, stop.max_stop_token_ids) == (2, 8, 3)
    args.max_stop_strings = 5000
    with pytest.raises(ValueError, match=r"^--max-stop-strings=5000 is invalid; allowed: an "):
        request_limits(args)


def test_lowered_limits_act_on_a_server():
    from fastdeploy.core.sampling_params import StopLimits

    limits = HTTPLimits(max_header_count=10, max_header_bytes=2048, max_body_bytes=4096)
    with fake_server(limits=limits, stop_limits=StopLimits(2, 8, 3)) as (url, _, _):
        body = {"prompt": [5], "max_tokens": 2, "stop": ["a", "b"]}
        assert httpx.post(url + "/v1/completions", json=body, timeout=10).status_code == 200
        r = httpx.post(url + "/v1/completions", json={**body, "stop": ["a", "b", "c"]}, timeout=10)
        assert r.status_code == 400 and "more than the cap of 2 (--max-stop-strings)" in r.text
        r = httpx.post(url + "/v1/completions", json={**body, "stop": ["a" * 9]}, timeout=10)
        assert r.status_code == 400 and "cap of 8 (--max-stop-chars)" in r.text
        r = httpx.post(
            url + "/v1/completions", json={**body, "stop_token_ids": [1] * 4}, timeout=10
        )
        assert r.status_code == 400 and "cap of 3 (--max-stop-token-ids)" in r.text
        r = httpx.post(url + "/v1/completions", json={"prompt": "x" * 5000}, timeout=10)
        assert r.status_code == 413
        headers = {f"x-h{i}": "v" for i in range(10)}
        assert httpx.get(url + "/v1/models", headers=headers, timeout=10).status_code == 431
        r = httpx.get(url + "/v1/models", headers={"x-pad": "p" * 3000}, timeout=10)
        assert r.status_code == 431
        assert httpx.get(url + "/v1/models", timeout=10).status_code == 200
