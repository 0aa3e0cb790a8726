"""Helpers to run a server for the tests: a free port, an in-thread uvicorn, waits with timeouts."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import uvicorn

from fastdeploy.core.sampling_params import StopLimits
from fastdeploy.entrypoints.engine_client.async_engine import AsyncLLMEngine
from fastdeploy.entrypoints.openai.app import build_app
from fastdeploy.entrypoints.openai.limits import HTTPLimits


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_group_pids(pgid: int) -> list[int]:
    """Pids of the processes still in process group ``pgid`` (a server started in a session of
    its own, and every process it started)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getpgid(int(entry.name)) == pgid:
                    pids.append(int(entry.name))
            except (ProcessLookupError, PermissionError):
                pass
    return pids


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``predicate`` every 50 ms; fail the test after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


@contextmanager
def serve_in_thread(
    engine,
    served_model_name: str = "fake-model",
    max_concurrency: int | None = None,
    limits: HTTPLimits | None = None,
    api_keys: tuple[str, ...] = (),
    http: str = "auto",
    stop_limits: StopLimits | None = None,
    tool_config=None,
    **engine_kwargs,
) -> Iterator[tuple[str, AsyncLLMEngine]]:
    """Serve ``engine`` with uvicorn on a thread at 127.0.0.1:<free port>, with the request
    ``limits`` (defaults when None) on uvicorn's ``http`` protocol (``auto``, ``httptools``,
    ``h11``), ``api_keys``, ``stop_limits`` and ``tool_config`` (the tool flags), as
    ``fastdeploy serve`` does; ``engine_kwargs``
    go to :class:`AsyncLLMEngine` (``engine_stall_timeout_s``, ...); yields (url, engine)."""
    async_engine = AsyncLLMEngine(engine, max_concurrency=max_concurrency, **engine_kwargs)
    limits = limits or HTTPLimits()
    app = build_app(
        async_engine,
        served_model_name,
        limits=limits,
        stop_limits=stop_limits,
        api_keys=api_keys,
        tool_config=tool_config,
    )
    port = free_port()
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port,
        log_level="warning",
        timeout_graceful_shutdown=2,
        **limits.uvicorn_kwargs(async_engine.metrics.observe_rejected, http),
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: server.started, 10, "the in-thread server to start")
    try:
        yield url, async_engine
    finally:
        server.should_exit = True
        thread.join(10)
        assert not thread.is_alive(), "the in-thread server did not stop"


def get_json(url: str, path: str) -> dict:
    """GET ``url + path`` and return the JSON body (asserting 200)."""
    r = httpx.get(url + path, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


@contextmanager
def fake_server(
    model: str = "fake-model", **kwargs
) -> Iterator[tuple[str, object, AsyncLLMEngine]]:
    """The fake engine (``max_model_len`` 128, 2 ms steps) served on a thread (``kwargs``: those
    of :func:`serve_in_thread`); yields ``(url, fake engine, async engine)``."""
    from fake_llm_engine import FakeEngine

    engine = FakeEngine(max_model_len=128, step_delay_s=0.002)
    with serve_in_thread(engine, model, max_concurrency=64, **kwargs) as (url, async_engine):
        yield url, engine, async_engine


def metric_samples(url: str) -> dict:
    """``{(sample name, sorted labels): value}`` of ``url``'s ``/metrics``."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=5).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out
