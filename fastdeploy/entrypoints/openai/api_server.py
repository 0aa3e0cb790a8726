"""The OpenAI-compatible server's HTTP layer: :func:`serve` runs the FastAPI app
(:mod:`fastdeploy.entrypoints.openai.app`) for an engine under uvicorn, in one API server process.

Launch with ``fastdeploy serve [args]`` or ``python -m fastdeploy.entrypoints.openai.api_server
[args]`` (same arguments: :func:`fastdeploy.entrypoints.server_args.make_arg_parser`). Start-up
(flag, device and port checks, the deployment plan, the engine's placement, the API server
processes) is :mod:`fastdeploy.entrypoints.launch`, which is handed :func:`serve`:
:func:`run_server` joins the two.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
from typing import Any

from fastdeploy import envs
from fastdeploy.entrypoints import launch
from fastdeploy.entrypoints.server_args import (
    make_arg_parser,
    request_limits,
    served_name,
    tool_config,
)

logger = logging.getLogger("fastdeploy.api_server")


def run_server(args: argparse.Namespace) -> int:
    """Start the server of ``args`` and serve HTTP until SIGINT/SIGTERM (or print the config);
    returns the exit status (see :func:`fastdeploy.entrypoints.launch.run_server`)."""
    return launch.run_server(args, serve)


def serve(
    args: argparse.Namespace,
    core: Any,
    index: int = 0,
    count: int = 1,
    sock: socket.socket | None = None,
    workers: Any = None,
) -> None:
    """Run the app for ``core`` under uvicorn until SIGINT/SIGTERM (API server ``index`` of
    ``count``; the first one's stop signals end the others, ``workers``, first). ``sock``: the
    listening socket the processes share (None: uvicorn binds ``--host``/``--port``)."""
    import uvicorn

    from fastdeploy.core.gc_heap import freeze_startup_heap
    from fastdeploy.entrypoints.engine_client.async_engine import AsyncLLMEngine
    from fastdeploy.entrypoints.openai.api_workers import concurrency_share
    from fastdeploy.entrypoints.openai.app import GracefulServer, build_app, check_http_stack
    from fastdeploy.metrics import ServerMetrics

    metrics = ServerMetrics(
        multiprocess_dir=os.environ.get("PROMETHEUS_MULTIPROC_DIR") if count > 1 else None,
        engine_stats=index == 0,
        model_name=served_name(args),
    )
    engine = AsyncLLMEngine(
        core,
        max_concurrency=concurrency_share(args.max_concurrency, count, index),
        metrics=metrics,
        engine_stall_timeout_s=args.engine_stall_timeout,
    )
    if count > 1:
        engine.max_concurrency_note = (
            f"this API server process's share of --max-concurrency={args.max_concurrency} "
            f"over {count} processes"
        )
    grace_s = args.timeout_graceful_shutdown
    if index == 0:
        check_http_stack()

    async def stop_workers() -> None:
        await asyncio.to_thread(workers.stop, grace_s + 15)

    http_limits, stop_limits = request_limits(args)
    app = build_app(
        engine,
        served_name(args),
        before_shutdown=stop_workers if workers is not None else None,
        api_server=(index, count),
        limits=http_limits,
        stop_limits=stop_limits,
        api_keys=args.api_key or (),
        tool_config=tool_config(args),
    )
    # uvicorn handles SIGINT/SIGTERM (graceful shutdown, then our lifespan stops the engine) and
    # afterwards re-raises the signal to the handler installed before it ran. This one makes
    # that a normal return, so a signalled server exits 0 instead of dying by the signal; a
    # signal before uvicorn has started raises KeyboardInterrupt (start-up stops the engine).
    stopped_by: list[int] = []
    started: list[Any] = []  # the uvicorn server, once made

    def on_signal(signum: int, _frame: Any) -> None:
        stopped_by.append(signum)
        if not (started and started[0].started):
            raise KeyboardInterrupt

    if index == 0:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_signal)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        # A backstop only: GracefulServer ends the requests itself when the grace period is over.
        timeout_graceful_shutdown=int(grace_s) + 5,
        **http_limits.uvicorn_kwargs(metrics.observe_rejected),
    )
    server = GracefulServer(
        config,
        engine,
        grace_s,
        on_shutdown=workers.signal_stop if workers is not None else None,
    )
    started.append(server)
    # Full collections skip the start-up heap; what the early freeze (launch's pre-import
    # thread) froze stays frozen, so this collects only what was allocated since.
    freeze_startup_heap("api server", envs.FD_GC_FREEZE(), keep_frozen=True)
    server.run(sockets=[sock] if sock is not None else None)
    if stopped_by:
        logger.info("stopped by %s", signal.Signals(stopped_by[0]).name)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m fastdeploy.entrypoints.openai.api_server``."""
    return run_server(make_arg_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
