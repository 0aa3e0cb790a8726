"""PD failure drills on CPU, each with real processes (``tcp`` transport), each ending with every
block accounted for (``docs/pd-disaggregation.md``, "Failures"):

* the decode node dies after the prefill node answered: the prefill node frees the blocks within
  the lease, and a client of the router gets an error;
* the prefill node dies after it answered: the decode node fails the request within 5 s with
  ``fail``, and with ``recompute`` the output still equals a mixed server's;
* the decode pool is too small: the request waits while heartbeats extend the lease, then
  completes; with a short ``--pd-decode-wait-timeout`` it gets a 503.

(Slow: loads the default model several times.)
"""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest
from pd_cluster import Cluster
from test_pd_e2e import answer, assert_all_released, completion_body, metrics, wait_until

pytestmark = pytest.mark.slow

TCP = ["--cache-transfer-protocol", "tcp"]
TIMEOUT = httpx.Timeout(120.0)


def prefill_leg(prefill_url: str, body: dict) -> dict:
    """Send the prefill leg as a router does; returns the node's ``kv_transfer_params``."""
    leg = body | {"kv_transfer_params": {"do_remote_decode": True}, "max_tokens": 1}
    r = httpx.post(prefill_url + "/v1/completions", json=leg | {"stream": False}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


def test_decode_node_killed_after_prefill_answered(tmp_path):
    with Cluster(tmp_path) as cluster:
        prefill = cluster.start_server(
            ["--splitwise-role", "prefill", "--pd-lease-s", "2", *TCP], name="prefill"
        )
        decode = cluster.start_server(["--splitwise-role", "decode", *TCP], name="decode")
        cluster.wait_healthy(prefill, decode)
        router = cluster.start_router(
            ["--prefill", prefill.url, "--decode", decode.url], name="router"
        )
        cluster.wait_healthy(router)
        body = completion_body(300, False)
        params = prefill_leg(prefill.url, body)
        assert metrics(prefill.url)["fastdeploy:pd_pending_send_blocks"] == len(
            params["remote_block_ids"]
        )
        os.killpg(decode.pid, signal.SIGKILL)
        decode.popen.wait(10)
        t0 = time.monotonic()
        # The prefill node frees the blocks within the lease (2 s) plus one sweep.
        wait_until(lambda: assert_all_released(prefill.url), 5)
        assert time.monotonic() - t0 < 5
        expired = 'fastdeploy:pd_pending_sends_released_total{reason="expired"}'
        assert metrics(prefill.url)[expired] == 1
        # A client of the router gets an error, not a hang; the prefill node keeps nothing.
        r = httpx.post(router.url + "/v1/completions", json=body, timeout=TIMEOUT)
        assert r.status_code >= 500, r.text
        assert "error" in r.json()
        wait_until(lambda: assert_all_released(prefill.url), 5)


def test_prefill_node_killed_after_it_answered(tmp_path):
    with Cluster(tmp_path) as cluster:
        prefill = cluster.start_server(["--splitwise-role", "prefill", *TCP], name="prefill")
        fail = cluster.start_server(["--splitwise-role", "decode", *TCP], name="decode-fail")
        recompute = cluster.start_server(
            ["--splitwise-role", "decode", "--kv-load-failure-policy", "recompute", *TCP],
            name="decode-recompute",
        )
        mixed = cluster.start_server(name="mixed")
        cluster.wait_healthy(prefill, fail, recompute, mixed)
        body = completion_body(300, False)
        params = prefill_leg(prefill.url, body)
        os.killpg(prefill.pid, signal.SIGKILL)
        prefill.popen.wait(10)
        leg = body | {"kv_transfer_params": params}
        t0 = time.monotonic()
        r = httpx.post(fail.url + "/v1/completions", json=leg, timeout=TIMEOUT)
        assert time.monotonic() - t0 < 5
        assert r.status_code == 502, r.text
        assert r.json()["error"]["code"] == "kv_transfer_failed"
        assert "PD transfer failed" in r.json()["error"]["message"]
        m = metrics(fail.url)
        assert m['fastdeploy:kv_transfer_failures_total{reason="claim"}'] == 1
        assert_all_released(fail.url)
        for stream in (False, True):
            want = answer(mixed.url, "/v1/completions", body | {"stream": stream})
            got = answer(recompute.url, "/v1/completions", leg | {"stream": stream})
            assert got == want
        assert_all_released(recompute.url)


def test_a_frozen_prefill_node_fails_the_decode_leg_at_the_transfer_deadline(tmp_path):
    """The prefill node answered, then froze (SIGSTOP: alive, its ports accept, nothing
    answers). With --pd-transfer-timeout 2 the decode leg gets its 502 at about 2 s (before:
    5 s, the side channel's own limit, whatever the deadline); once the node resumes it frees
    the blocks."""
    deadline = ["--pd-transfer-timeout", "2"]
    with Cluster(tmp_path) as cluster:
        prefill = cluster.start_server(
            ["--splitwise-role", "prefill", *deadline, *TCP], name="prefill"
        )
        decode = cluster.start_server(
            ["--splitwise-role", "decode", *deadline, *TCP], name="decode"
        )
        cluster.wait_healthy(prefill, decode)
        body = completion_body(300, False)
        params = prefill_leg(prefill.url, body)
        os.killpg(prefill.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            r = httpx.post(
                decode.url + "/v1/completions", json=body | {"kv_transfer_params": params},
                timeout=TIMEOUT,
            )  # fmt: skip
            seconds = time.monotonic() - t0
            print(f"the decode leg failed after {seconds:.2f} s (deadline 2 s)")
        finally:
            os.killpg(prefill.pid, signal.SIGCONT)
        assert r.status_code == 502, r.text
        assert "PD transfer failed" in r.json()["error"]["message"]
        assert 1.9 <= seconds <= 2 + 1.0, seconds
        wait_until(lambda: assert_all_released(decode.url, prefill.url), 10)


def test_decode_pool_too_small_waits_then_completes_or_503(tmp_path):
    # 9 blocks of 64 tokens: 8 usable = 512 tokens; a local request of 300 + 200 tokens holds
    # all 8 while the PD request waits for 2.
    small = ["--splitwise-role", "decode", "--num-gpu-blocks-override", "9", *TCP]
    with Cluster(tmp_path) as cluster:
        prefill = cluster.start_server(
            ["--splitwise-role", "prefill", "--pd-lease-s", "1", *TCP], name="prefill"
        )
        waits = cluster.start_server(small, name="decode-waits")
        # The hog holds all 8 blocks for its last ~50 tokens only (about 1 s on a 2-core CPU,
        # less on a faster one): the impatient node's timeout must be well under that.
        impatient = cluster.start_server(
            [*small, "--pd-decode-wait-timeout", "0.25"], name="decode-impatient"
        )
        cluster.wait_healthy(prefill, waits, impatient)
        for decode, expect in ((waits, 200), (impatient, 503)):
            hog = completion_body(300, False) | {"max_tokens": 200, "ignore_eos": True}
            done = {}

            def run_hog(url=decode.url, hog=hog, done=done):
                done["r"] = httpx.post(url + "/v1/completions", json=hog, timeout=TIMEOUT)

            thread = threading.Thread(target=run_hog)
            thread.start()
            wait_until(
                lambda url=decode.url: _assert(metrics(url)["fastdeploy:num_free_kv_blocks"] == 0),
                30,
            )
            body = completion_body(100, False)
            params = prefill_leg(prefill.url, body)
            r = httpx.post(
                decode.url + "/v1/completions",
                json=body | {"kv_transfer_params": params},
                timeout=TIMEOUT,
            )
            thread.join(120)
            assert done["r"].status_code == 200
            assert r.status_code == expect, r.text
            if expect == 200:
                # It waited longer than the 1 s lease: heartbeats kept the blocks alive.
                assert r.json()["usage"]["completion_tokens"] == 12
                released = metrics(prefill.url)
                assert released['fastdeploy:pd_pending_sends_released_total{reason="done"}'] >= 1
            else:
                assert "pd_decode_wait_timeout" in r.json()["error"]["message"]
            wait_until(lambda url=decode.url: assert_all_released(url, prefill.url), 10)


def _assert(ok: bool) -> None:
    assert ok


def test_pd_with_a_secret_end_to_end(tmp_path):
    """Prefill node, decode node and router share ``--pd-secret-file``: honest traffic works; an
    unsigned reference is a 400 and a forged HEARTBEAT is refused and counted; when the decode
    node refuses a leg, the router's signed ABORT frees the prefill blocks at once."""
    from fastdeploy.splitwise.side_channel import SideChannelError, send_control

    secret = tmp_path / "pd.secret"
    secret.write_text("0123456789abcdef0123456789abcdef\n")
    auth = ["--pd-secret-file", str(secret)]
    with Cluster(tmp_path) as cluster:
        prefill = cluster.start_server(["--splitwise-role", "prefill", *auth, *TCP], name="p")
        decode = cluster.start_server(["--splitwise-role", "decode", *auth, *TCP], name="d")
        cluster.wait_healthy(prefill, decode)
        router = cluster.start_router(
            ["--prefill", prefill.url, "--decode", decode.url, *auth], name="router"
        )
        cluster.wait_healthy(router)
        assert "PD is unauthenticated" not in prefill.log_tail(100_000)
        body = completion_body(100, False)
        r = httpx.post(router.url + "/v1/completions", json=body, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 12
        params = prefill_leg(prefill.url, body)
        unsigned = {k: v for k, v in params.items() if k != "auth"}
        r = httpx.post(
            decode.url + "/v1/completions",
            json=body | {"kv_transfer_params": unsigned},
            timeout=TIMEOUT,
        )
        assert r.status_code == 400 and "(unsigned)" in r.json()["error"]["message"]
        with pytest.raises(SideChannelError, match=r"\(unsigned\)"):
            send_control(
                params["remote_host"],
                params["remote_port"],
                "HEARTBEAT",
                [params["remote_request_id"]],
                auth=None,
            )
        unsigned_total = 'fastdeploy:pd_auth_rejected_total{reason="unsigned"}'
        # Counted at the node's next step (it steps while it holds blocks for a decode node).
        wait_until(lambda: _assert(metrics(prefill.url).get(unsigned_total) == 1), 10)
        r = httpx.post(  # the real reference still works
            decode.url + "/v1/completions",
            json=body | {"kv_transfer_params": params},
            timeout=TIMEOUT,
        )
        assert r.status_code == 200, r.text
        # The decode node refuses this leg (min_tokens > max_tokens; the prefill leg drops
        # min_tokens): the router's signed ABORT frees the prefill node's blocks now.
        bad = body | {"min_tokens": 50}
        r = httpx.post(router.url + "/v1/completions", json=bad, timeout=TIMEOUT)
        assert r.status_code == 400, r.text
        wait_until(lambda: assert_all_released(prefill.url, decode.url), 5)
        m = metrics(prefill.url)
        assert m['fastdeploy:pd_pending_sends_released_total{reason="abort"}'] == 1
        assert m[unsigned_total] == 1
