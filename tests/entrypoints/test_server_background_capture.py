"""The server while the engine captures CUDA graphs in the background (issue #47), against a fake
engine that captures one graph per ``capture_next_graph`` call, slowly: ``/health`` is ready
before capture ends, a request is answered meanwhile, and ``/v1/server_info`` and ``/metrics``
show the graphs captured out of the total, and the failed one."""

from __future__ import annotations

import threading
import time

import httpx
from fake_llm_engine import FakeEngine
from http_server_utils import get_json, metric_samples, serve_in_thread, wait_until

from fastdeploy.model_executor.graph_optimization.capture_order import (
    CaptureProgress,
    CaptureTask,
)

TASKS = [CaptureTask("prefill", 512), CaptureTask("decode", 8), CaptureTask("decode", 4),
         CaptureTask("decode", 2), CaptureTask("prefill", 1024, phase=2)]  # fmt: skip


class CapturingEngine(FakeEngine):
    """A fake engine with a background capture: each graph takes ``capture_s``; the capture of
    decode bucket 2 raises. It waits at the start until ``go`` is set."""

    def __init__(self, capture_s: float) -> None:
        super().__init__(max_model_len=128, step_delay_s=0.002)
        self.capture_s = capture_s
        self.progress = CaptureProgress(list(TASKS))
        self.go = threading.Event()

    def graph_capture_pending(self) -> bool:
        return not self.progress.done

    def capture_next_graph(self):
        self.go.wait(30)
        task = self.progress.next_task()
        time.sleep(self.capture_s)
        if task.size == 2:
            self.progress.failed(task, "OutOfMemoryError: fake", self.capture_s)
        else:
            self.progress.captured(task, self.capture_s)
        return {"kind": task.kind, "size": task.size}

    def get_stats(self) -> dict:
        return {**super().get_stats(), "graph_capture": self.progress.stats()}


def test_health_is_ready_and_requests_answer_while_graphs_are_captured():
    engine = CapturingEngine(capture_s=0.3)
    with serve_in_thread(engine, "fake-model", max_concurrency=8) as (url, _):
        assert httpx.get(url + "/health", timeout=5).status_code == 200  # capture not begun
        info = get_json(url, "/v1/server_info")["stats"]["graph_capture"]
        assert info["captured"] == 0 and info["total"] == 5 and not info["done"]
        engine.go.set()
        body = {"model": "fake-model", "prompt": "hi", "max_tokens": 3}
        r = httpx.post(url + "/v1/completions", json=body, timeout=20)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        during = get_json(url, "/v1/server_info")["stats"]["graph_capture"]
        assert not during["done"]  # answered while graphs were still being captured
        wait_until(
            lambda: get_json(url, "/v1/server_info")["stats"]["graph_capture"]["done"],
            20,
            "the capture to end",
        )
        info = get_json(url, "/v1/server_info")["stats"]["graph_capture"]
        assert (info["captured"], info["failed"], info["total"]) == (4, 1, 5)
        assert info["failures"] == [
            {"kind": "decode", "size": 2, "reason": "OutOfMemoryError: fake"}
        ]
        samples = metric_samples(url)
        assert samples[("fastdeploy:cuda_graph_buckets_captured", ())] == 4
        assert samples[("fastdeploy:cuda_graph_buckets_planned", ())] == 5
        assert samples[("fastdeploy:cuda_graph_buckets_failed", ())] == 1
        assert httpx.get(url + "/health", timeout=5).status_code == 200
