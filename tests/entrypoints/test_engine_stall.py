"""Health sees a stuck engine (``--engine-stall-timeout``): while a request is in flight and the
engine finishes no step for longer than the threshold, ``/health`` answers 503 with the reason
(and ``fastdeploy:engine_stalled`` is 1); once steps resume it answers 200 again and the request
completes. An idle engine is healthy however long it sleeps.

* the thread engine (``--disable-frontend-multiprocessing``'s shape): the fake engine, served in
  a thread, whose step blocks until the test lets it go;
* the engine process (the default) and ``--api-server-count 2``: ``fastdeploy serve`` with the
  default model, its engine process stopped with SIGSTOP (issue 43, found 6: 20 s of SIGSTOP and
  ``/health`` kept answering 200), then continued.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest
from fake_llm_engine import FakeEngine
from http_server_utils import metric_samples, serve_in_thread, wait_until

STALLED = ("fastdeploy:engine_stalled", ())


class FreezableEngine(FakeEngine):
    """The fake engine; while ``go`` is clear, a step blocks (as a hung device call would)."""

    def __init__(self) -> None:
        super().__init__(max_model_len=128, step_delay_s=0.01)
        self.go = threading.Event()
        self.go.set()
        self.frozen_steps = 0

    def step(self):
        if not self.go.is_set():
            self.frozen_steps += 1
            self.go.wait(60)
        return super().step()


def stream_in_background(url: str, body: dict, events: list) -> threading.Thread:
    """Stream ``body`` on a thread; ``events`` gets each data line's JSON, then ``"[DONE]"``."""

    def run() -> None:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    events.append("[DONE]")
                elif line.startswith("data: "):
                    events.append(json.loads(line[6:]))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def health(url: str) -> tuple[int, dict]:
    r = httpx.get(url + "/health", timeout=10)
    return r.status_code, r.json()


def test_thread_engine_stalled_then_resumed():
    engine = FreezableEngine()
    threshold = 1.0
    with serve_in_thread(engine, engine_stall_timeout_s=threshold) as (url, _):
        try:
            check_stalled_then_resumed(url, engine, threshold)
        finally:
            engine.go.set()  # a failed check must not leave the server's loop blocked


def check_stalled_then_resumed(url: str, engine: FreezableEngine, threshold: float) -> None:
    """Idle, then frozen with a request in flight (503), then let go (200, completed)."""
    # Idle for longer than the threshold (the loop waits for commands): healthy.
    time.sleep(threshold * 2)
    assert health(url) == (200, {"status": "ok"})
    engine.go.clear()
    events: list = []
    body = {"prompt": "hello", "max_tokens": 12, "ignore_eos": True, "stream": True}
    sent_at = time.monotonic()  # the stall clock starts when the server queues it, later
    thread = stream_in_background(url, body, events)
    wait_until(lambda: engine.frozen_steps > 0, 10, "a step to block")
    wait_until(lambda: health(url)[0] == 503, threshold + 5, "/health to answer 503")
    seen_after = time.monotonic() - sent_at
    assert threshold < seen_after < threshold + 2, seen_after
    status, body_503 = health(url)
    assert status == 503 and body_503["status"] == "stalled", body_503
    assert "has not finished a step for" in body_503["reason"]
    assert "1 request(s) in flight" in body_503["reason"]
    assert "--engine-stall-timeout=1" in body_503["reason"]
    wait_until(lambda: metric_samples(url)[STALLED] == 1, 5, "engine_stalled 1")
    engine.go.set()
    wait_until(lambda: health(url)[0] == 200, 5, "/health to answer 200 again")
    thread.join(30)
    assert events[-1] == "[DONE]", events[-3:]
    text = "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])
    assert len(text) == 12 and events[-2]["choices"][0]["finish_reason"] == "length"
    wait_until(lambda: metric_samples(url)[STALLED] == 0, 5, "engine_stalled 0")


def test_zero_turns_the_check_off():
    engine = FreezableEngine()
    with serve_in_thread(engine, engine_stall_timeout_s=0) as (url, _):
        engine.go.clear()
        try:
            events: list = []
            body = {"prompt": "hi", "max_tokens": 3, "stream": True}
            thread = stream_in_background(url, body, events)
            wait_until(lambda: engine.frozen_steps > 0, 10, "a step to block")
            time.sleep(1.5)
            assert health(url) == (200, {"status": "ok"})
        finally:
            engine.go.set()
        thread.join(30)
        assert events[-1] == "[DONE]"


# ---------------------------------------------------------------- the real server, SIGSTOP
@pytest.mark.slow
@pytest.mark.parametrize("count", [1, 2], ids=["engine-process", "api-server-count-2"])
def test_sigstopped_engine_process_is_reported_then_recovers(count, tmp_path):
    from server_process import engine_pid, serve

    threshold = 4
    args = ["--max-model-len", "512", "--max-num-seqs", "8", "--engine-stall-timeout",
            str(threshold), "--log-level", "warning"]  # fmt: skip
    with serve(tmp_path, *args, count=count) as srv:
        pid = engine_pid(srv.url)
        assert pid != srv.proc.pid
        events: list = []
        body = {"prompt": "Tell me a story.", "max_tokens": 64, "ignore_eos": True,
                "stream": True, "temperature": 0}  # fmt: skip
        thread = stream_in_background(srv.url, body, events)
        wait_until(lambda: len(events) >= 3, 60, "the stream to produce tokens")
        os.kill(pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            # Every API server process answers 503 (health is asked on fresh connections, which
            # the processes accept in turn), within the threshold plus the check's slack.
            wait_until(lambda: health(srv.url)[0] == 503, threshold + 5, "/health 503")
            assert time.monotonic() - stopped_at < threshold + 3
            answers = [health(srv.url) for _ in range(8)]
            assert all(status == 503 for status, _ in answers), answers
            assert all(b["status"] == "stalled" for _, b in answers), answers
            assert "has not finished a step" in answers[0][1]["reason"]
            if count == 1:  # set by a check once a second: it may lag /health by that
                wait_until(lambda: metric_samples(srv.url)[STALLED] == 1, 3, "engine_stalled 1")
            # Stopped longer than the engine's limit for a front end that does not read
            # (frontend_router.STUCK_S, 10 s): resuming must not cut a front end off.
            time.sleep(max(0.0, 12 - (time.monotonic() - stopped_at)))
        finally:
            os.kill(pid, signal.SIGCONT)
        wait_until(lambda: health(srv.url)[0] == 200, 10, "/health 200 after SIGCONT")
        thread.join(120)
        assert events and events[-1] == "[DONE]", events[-3:]
        assert not any("error" in e for e in events[:-1] if isinstance(e, dict)), events
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        answers = [health(srv.url)[0] for _ in range(8)]
        assert answers == [200] * 8
        if count == 1:
            wait_until(lambda: metric_samples(srv.url)[STALLED] == 0, 3, "engine_stalled 0")
        assert "cut off" not in srv.log(10**9)
        assert "engine has not finished a step" in srv.log(10**9)  # logged at the start


@pytest.mark.slow
def test_a_bad_threshold_exits_2_naming_the_flag():
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "fastdeploy.entrypoints.openai.api_server"]
    out = subprocess.run(
        [*cmd, "--engine-stall-timeout", "-5"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2, out.stderr
    assert "--engine-stall-timeout=-5.0 is invalid; allowed: seconds > 0, or 0" in out.stderr
    printed = subprocess.run(
        [*cmd, "--print-config", "--engine-stall-timeout", "7"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert json.loads(printed.stdout)["server"]["engine_stall_timeout"] == 7
