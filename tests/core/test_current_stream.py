"""host_staging.current_stream / record_event: one torch Stream per (device, raw handle), reused.

The CUDA calls are replaced by stand-ins, so this runs on the CPU-only CI; the GPU tests
(test_no_host_sync_gpu, test_engine_gpu) run the real path.
"""

from __future__ import annotations

import torch

from fastdeploy.core import host_staging


def fake_cuda(monkeypatch, state: dict) -> list:
    """Stand-ins for the three CUDA calls; returns the list of Streams built."""
    built = []

    def current_stream(index):
        built.append(("stream", index, state["raw"]))
        return built[-1]

    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: state["device"], raising=False)
    monkeypatch.setattr(
        torch._C, "_cuda_getCurrentRawStream", lambda index: state["raw"] + index, raising=False
    )
    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(host_staging, "_streams", {})
    return built


def test_a_stream_is_built_once_per_device_and_handle(monkeypatch):
    state = {"device": 0, "raw": 1000}
    built = fake_cuda(monkeypatch, state)
    first = host_staging.current_stream()
    assert host_staging.current_stream() is first and built == [("stream", 0, 1000)]
    state["raw"] = 2000  # another stream became current (a side stream, capture)
    side = host_staging.current_stream()
    assert side == ("stream", 0, 2000) and side is not first
    state["device"] = 1  # the same handle value on another device is another stream
    assert host_staging.current_stream() == ("stream", 1, 2000)
    state["device"], state["raw"] = 0, 1000
    assert host_staging.current_stream() is first
    assert len(built) == 3


def test_the_cache_is_bounded(monkeypatch):
    state = {"device": 0, "raw": 0}
    built = fake_cuda(monkeypatch, state)
    for raw in range(host_staging.MAX_CACHED_STREAMS + 5):
        state["raw"] = raw
        host_staging.current_stream()
    assert len(host_staging._streams) <= host_staging.MAX_CACHED_STREAMS
    assert len(built) == host_staging.MAX_CACHED_STREAMS + 5


def test_record_event_records_on_the_current_stream(monkeypatch):
    state = {"device": 0, "raw": 7}
    fake_cuda(monkeypatch, state)

    class Event:
        def record(self, stream=None):
            self.stream = stream

    event = Event()
    host_staging.record_event(event)
    assert event.stream == ("stream", 0, 7)
