"""The PD test harness itself: processes are killed with their children even when the test fails
(fast); two mixed servers and ``fastdeploy router`` in front of them start in parallel, greedy
chat completions through the router equal one sent to a server directly, and no process is left
afterwards (slow: loads the default model twice)."""

from __future__ import annotations

import sys
import time

import httpx
import pytest
from pd_cluster import Cluster, group_pids

# A parent that ignores SIGTERM and a grandchild that does too; both must still go.
STUBBORN = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
print("started", flush=True)
time.sleep(600)
"""

CHAT = {
    "messages": [{"role": "user", "content": "What is the capital of France?"}],
    "temperature": 0,
    "max_tokens": 8,
}


def content(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


@pytest.mark.slow
def test_a_failing_test_leaves_no_process(tmp_path):
    cluster = Cluster(tmp_path, grace_s=0.5)
    with pytest.raises(RuntimeError, match="the test failed"), cluster:
        proc = cluster.start("stubborn", [sys.executable, "-c", STUBBORN], "http://unused")
        deadline = time.monotonic() + 30
        while len(group_pids(proc.pid)) < 2 or "started" not in proc.log_tail():
            assert time.monotonic() < deadline, proc.log_tail()
            time.sleep(0.05)
        t_fail = time.monotonic()
        raise RuntimeError("the test failed")
    assert group_pids(proc.pid) == []
    assert proc.popen.returncode == -9  # SIGKILL after the grace period
    assert time.monotonic() - t_fail < 5


@pytest.mark.slow
def test_a_dead_server_fails_fast_with_its_output(tmp_path):
    with Cluster(tmp_path) as cluster:
        proc = cluster.start_server(["--max-num-seqs", "0"], name="bad")
        t0 = time.monotonic()
        with pytest.raises(AssertionError, match=r"bad \(pid \d+\) exited with status 2") as e:
            cluster.wait_healthy(proc, timeout=120)
        assert "max_num_seqs" in str(e.value) and time.monotonic() - t0 < 60


@pytest.mark.slow
def test_router_in_front_of_two_mixed_servers(tmp_path):
    t0 = time.monotonic()
    with Cluster(tmp_path) as cluster:
        a = cluster.start_server(name="mixed-a")
        b = cluster.start_server(name="mixed-b")
        router = cluster.start_router(["--backend", a.url, b.url], name="router")
        cluster.wait_healthy(a, b, router)
        t_up = time.monotonic()
        direct = content(httpx.post(a.url + "/v1/chat/completions", json=CHAT, timeout=60))
        # Round robin: two calls through the router reach both servers.
        routed = [
            content(httpx.post(router.url + "/v1/chat/completions", json=CHAT, timeout=60))
            for _ in range(2)
        ]
        assert direct and routed == [direct, direct]
        groups = [p.pid for p in cluster.procs]
        assert all(group_pids(g) for g in groups)
        t_requests = time.monotonic()
    assert [g for g in groups if group_pids(g)] == [], "a process group outlived the cluster"
    t_end = time.monotonic()
    print(
        f"\nstart-up {t_up - t0:.1f} s, requests {t_requests - t_up:.1f} s, "
        f"shutdown {t_end - t_requests:.1f} s, total {t_end - t0:.1f} s"
    )
