"""Load as a test (issue 43): ``fastdeploy serve`` with the default model on CPU under waves of
concurrent streams, through the server and through ``fastdeploy router`` in front of it.

* 1,000 streams at once, 4 tokens each after a prompt of a few tokens (CPU time is the limit),
  every other client leaving after its first token. Each request completes, aborts cleanly or
  gets a 429 from ``--max-concurrency`` (512, the default); nothing else: no other status, no
  error event, no broken stream. The server's counters agree: every admitted request finished
  by ``length`` or ``abort`` (none by ``error``), every 429 is a ``queue_full`` refusal.
  Afterwards every KV block is free, ``/health`` is 200 (server and router), and the RSS of the
  server process and of the engine process is within 10% of its level before (measured after a
  first wave of the same size, so that what the allocators keep from first use is not counted;
  ``VmRSS`` of ``/proc/<pid>/status``, the engine's pid from ``/v1/server_info``).
* 300 streams at once with the engine batching them all (``--max-num-seqs 320``): each step's
  message up the engine's pipe carries about 300 outputs, more than the 64 KiB pipe buffer; with
  ``--api-server-count 2``, 600 streams (each process gets its own requests' outputs, so one of
  them gets at least 300 per step). No stream may get an error event, and ``/health`` stays
  200. Before 2bdde33 (issue 43, found 1) the server took the partial read for the engine's
  death: every stream got an error event and ``/health`` answered 503 (checked: 300 of 300
  streams, and 371 of 600 with two processes, failed that way on 2bdde33^).

The client is ``benchmarks/load_client.py`` (raw asyncio sockets, one per stream), in this process;
the open-files limit is raised for its sockets and the servers inherit it.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from http_server_utils import get_json, metric_samples
from server_process import engine_pid, router, rss_kib, serve, wait_all_blocks_free
from support import load_benchmark_module

pytestmark = pytest.mark.slow

load_client = load_benchmark_module("load_client")

NUM_STREAMS = 1000
MAX_TOKENS = 4
MAX_CONCURRENCY = 512  # the server's default
RSS_GROWTH_LIMIT = 1.10


@pytest.fixture(autouse=True)
def open_files():
    """One socket per stream in this process, and as many in the server (and twice as many in
    the router); CI's soft limit may be 1,024."""
    needed = 2 * NUM_STREAMS + 512
    if load_client.raise_open_files_limit(needed) < needed:
        pytest.skip(f"the open-files limit cannot be raised to {needed}")


def wave(url: str, num: int, max_tokens: int, first_index: int) -> object:
    """One wave of ``num`` streams; asserts each one's outcome is allowed; returns the result."""
    result = asyncio.run(
        load_client.run_wave(url, num, max_tokens, leave_every=2, first_index=first_index)
    )
    counts = result.counts
    assert counts["error"] == 0, (counts, result.errors)
    assert counts["ok"] + counts["aborted"] + counts["429"] == num, counts
    return result


def server_rss(url: str, server_pid: int) -> dict[str, int]:
    return {"server": rss_kib(server_pid), "engine": rss_kib(engine_pid(url))}


def test_thousand_streams_half_leaving_through_the_server_and_the_router(tmp_path):
    started = time.monotonic()
    with serve(tmp_path, "--max-model-len", "512", "--log-level", "warning") as srv:
        timings = {"start": time.monotonic() - started}
        admitted = refused = 0
        # Warm-up: the same load once, so the allocators' growth on first use is not counted.
        first = wave(srv.url, NUM_STREAMS, MAX_TOKENS, 0)
        wait_all_blocks_free(srv.url)
        before = server_rss(srv.url, srv.proc.pid)
        runs = [first]
        runs.append(wave(srv.url, NUM_STREAMS, MAX_TOKENS, NUM_STREAMS))
        timings["direct"] = runs[-1].seconds
        with router(tmp_path, srv.url) as rtr:
            runs.append(wave(rtr.url, NUM_STREAMS, MAX_TOKENS, 2 * NUM_STREAMS))
            timings["router"] = runs[-1].seconds
            for run in runs:
                # A real load: the server was full at some point (direct), and both kinds of
                # client were served.
                assert run.counts["ok"] >= 100 and run.counts["aborted"] >= 100, run.counts
                admitted += run.counts["ok"] + run.counts["aborted"]
                refused += run.counts["429"]
            assert runs[0].counts["429"] > 0 and runs[1].counts["429"] > 0
            free, total = wait_all_blocks_free(srv.url)
            assert free == total > 0
            assert rtr.health()[0] == 200
            assert srv.health() == (200, {"status": "ok"})
        samples = metric_samples(srv.url)
        finished = {
            reason: samples[("fastdeploy:request_success_total", (("finished_reason", reason),))]
            for reason in ("stop", "length", "abort", "error")
        }
        assert finished["error"] == 0 and finished["stop"] == 0, finished
        assert finished["length"] + finished["abort"] == admitted, (finished, admitted)
        assert finished["abort"] >= sum(r.counts["aborted"] for r in runs[:2]) * 0.9, finished
        rejected = {
            labels[0][1]: v
            for (name, labels), v in samples.items()
            if name == "fastdeploy:request_rejected_total"
        }
        assert rejected["queue_full"] == refused
        assert sum(rejected.values()) == refused, rejected
        assert samples[("fastdeploy:num_free_kv_blocks", ())] == total
        after = server_rss(srv.url, srv.proc.pid)
        report = {k: (before[k], after[k]) for k in before}
        print(f"RSS KiB (before, after): {report}; outcomes: "
              f"{[r.as_dict() for r in runs]}; seconds: {timings}")  # fmt: skip
        for name in before:
            assert after[name] <= before[name] * RSS_GROWTH_LIMIT, report


def poll_max_running(url: str, stop: threading.Event, seen: list) -> None:
    """Keep the largest ``num_running`` the engine reported until ``stop`` is set."""
    while not stop.is_set():
        try:
            seen.append(get_json(url, "/v1/server_info")["stats"].get("num_running", 0))
        except Exception:  # noqa: BLE001 - a busy server may answer slowly; keep polling
            pass
        time.sleep(0.2)


@pytest.mark.parametrize(
    ("count", "num"), [(1, 300), (2, 600)], ids=["engine-process", "api-server-count-2"]
)
def test_three_hundred_outputs_per_step_keep_the_engine_alive(count, num, tmp_path):
    """``num`` streams batched in one step: with two API server processes each gets its own
    requests' outputs, so 600 streams give one of them at least 300 outputs per step."""
    args = ["--max-model-len", "256", "--max-num-seqs", str(num + 20), "--max-concurrency",
            "1024", "--max-num-batched-tokens", "4096", "--log-level", "warning"]  # fmt: skip
    # 1 GiB of KV (the default) holds 363 blocks of 64 tokens; each stream needs one.
    env = {"FD_CPU_KV_CACHE_SPACE": str(max(1, num // 300))}
    with serve(tmp_path, *args, count=count, env=env) as srv:
        stop, seen = threading.Event(), []
        poller = threading.Thread(target=poll_max_running, args=(srv.url, stop, seen))
        poller.start()
        try:
            # 8 tokens each, none leaving: they overlap for several steps of ~num outputs.
            result = asyncio.run(load_client.run_wave(srv.url, num, 8, leave_every=0))
        finally:
            stop.set()
            poller.join(30)
        assert result.counts["ok"] == num, (result.counts, result.errors)
        assert max(seen) >= 0.95 * num, f"the engine ran at most {max(seen)} requests at once"
        assert srv.health() == (200, {"status": "ok"})
        wait_all_blocks_free(srv.url)
        assert "exited" not in srv.log(10**9), srv.log()
