"""Start-up of the OpenAI-compatible server (``fastdeploy serve``): everything between the parsed
command line and the HTTP server.

:func:`run_server`, in order: the server's flag rules
(:func:`~fastdeploy.entrypoints.server_args.check_server_args`), the device and port checks
(before the model's config is even read), the deployment plan (resolved once:
:func:`~fastdeploy.config.resolve.resolve_deployment`; ``--print-config`` prints it and exits),
the engine's placement (:func:`place_engine`: its own process, or a thread of this one), and the
API server processes (``--api-server-count``). The HTTP layer is handed in as ``serve``
(:func:`fastdeploy.entrypoints.openai.api_server.serve`), so start-up never imports it back.

A bad argument, a port in use or a device this machine lacks prints one ``error: ...`` line and
exits with status 2, before the model loads. ``--print-config`` imports neither the web stack
nor the model code it does not need.
"""

from __future__ import annotations

import argparse
import atexit
import errno
import importlib
import json
import logging
import os
import shutil
import socket
import sys
import tempfile
import threading
from collections.abc import Callable
from typing import Any

from fastdeploy import envs
from fastdeploy.config import DeploymentPlan, FDConfig
from fastdeploy.config.resolve import resolve_deployment
from fastdeploy.engine.args_utils import EngineArgs
from fastdeploy.entrypoints.engine_client.process_client import EngineCoreProcess, EngineStartError
from fastdeploy.entrypoints.openai.auth import resolve_api_keys
from fastdeploy.entrypoints.server_args import (
    check_server_args,
    server_not_supported,
    server_summary,
)

logger = logging.getLogger("fastdeploy.api_server")

#: The HTTP layer: ``serve(args, core, index=0, count=1, sock=None, workers=None)`` runs the
#: app for ``core`` until SIGINT/SIGTERM (:func:`fastdeploy.entrypoints.openai.api_server.serve`).
ServeFn = Callable[..., None]


def run_server(args: argparse.Namespace, serve: ServeFn) -> int:
    """Start the server described by ``args`` and serve with ``serve`` until SIGINT/SIGTERM (or
    print the config); returns the exit status: 0, 1 (the engine failed to start), 2 (a bad
    argument, a port in use, a device this machine lacks: one ``error: ...`` line on stderr,
    before the model loads) or 130 (interrupted while starting).
    """
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        check_server_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    count = args.api_server_count
    if count > 1 and not args.print_config:
        multiprocess_metrics_dir()  # before anything imports prometheus_client
    try:
        # Resolved once, here: the API server processes after the first get these args.
        args.api_key = resolve_api_keys(args.api_key) or None
        engine_args = EngineArgs.from_cli_args(args)  # once per start
        if not args.print_config:  # fail fast, before the model's config is even read
            check_host(args, engine_args)
        config, plan = resolve_deployment(engine_args)
        if args.print_config:
            print(json.dumps(resolved_config(args, config, plan), indent=2))
            return 0
        if config.parallel_config.node_rank > 0:
            return run_other_node(config)
        problems = server_not_supported(args, config.parallel_config.splitwise_role)
        if problems:
            raise ValueError("; ".join(problems))
        if not args.disable_frontend_multiprocessing:
            import_http_stack_in_background()  # while the engine process loads the model
        try:
            core = place_engine(args, config, plan)
        except EngineStartError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:  # the engine process was killed on the way out
            print("interrupted while the engine was starting", file=sys.stderr)
            return 130
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return serve_with_engine(args, config, core, serve)


#: What the HTTP layer imports once the engine is ready (api_server.serve); imported earlier,
#: on a thread, they cost nothing between the engine's "ready" and the port's first answer.
HTTP_STACK_MODULES = (
    "uvicorn",
    "fastapi",
    "fastdeploy.metrics",
    "fastdeploy.entrypoints.engine_client.async_engine",
    "fastdeploy.entrypoints.openai.app",
    "fastdeploy.entrypoints.openai.api_workers",
)


def import_http_stack_in_background() -> threading.Thread:
    """Import :data:`HTTP_STACK_MODULES` on a daemon thread and return it (started).

    The API server process has nothing to do while its engine process loads the model, and
    the web stack's imports (about 0.4-0.8 s) would otherwise run after the engine is ready,
    delaying ``/health`` and the first token by as much (issue #47). An import that fails here
    is ignored: ``serve`` imports the same modules again and raises it there, as before. Then
    the start-up heap is frozen (:func:`~fastdeploy.core.gc_heap.freeze_startup_heap`), so
    its full collection is off the path to serving as well."""

    def run() -> None:
        for name in HTTP_STACK_MODULES:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - raised again, in context, by serve
                logger.debug("pre-import of %s failed", name, exc_info=True)
                return
        # The full collection before the freeze (0.3-0.4 s with torch imported) runs now too;
        # serve() then freezes only what it allocated since (keep_frozen).
        from fastdeploy.core.gc_heap import freeze_startup_heap

        freeze_startup_heap("api server (early)", envs.FD_GC_FREEZE())

    thread = threading.Thread(target=run, name="fastdeploy-import-http", daemon=True)
    thread.start()
    return thread


def check_host(args: argparse.Namespace, engine_args: EngineArgs) -> None:
    """What this machine must offer before the model's config is read: the device, a valid
    ``FD_GC_FREEZE`` (used after start-up) and ``FD_GRAPH_CAPTURE_BUSY_SHARE`` (read by the
    engine process, seconds later), and the ports (``--port`` on node 0, and a PD
    node's ``--pd-comm-port``).

    Raises:
        ValueError: naming the device, variable or port and why.
    """
    from fastdeploy.engine.engine import check_device_available

    check_device_available(engine_args.resolve_device())
    envs.FD_GC_FREEZE()  # used after start-up: a bad value fails here, before the load
    envs.FD_GRAPH_CAPTURE_BUSY_SHARE()  # read by the engine process, after its imports
    if engine_args.node_rank == 0:  # other nodes serve nothing
        check_port_free(args.host, args.port)
    if engine_args.splitwise_role != "mixed" and engine_args.pd_comm_port:
        if engine_args.pd_comm_port == args.port:
            raise ValueError(
                f"--pd-comm-port={args.port} is invalid: it is also --port; allowed: another port"
            )
        check_port_free(engine_args.pd_host, engine_args.pd_comm_port, "--pd-comm-port")


def place_engine(args: argparse.Namespace, config: FDConfig, plan: DeploymentPlan) -> Any:
    """Start the engine where ``args`` put it: a process of its own serving
    ``--api-server-count`` front ends (the default), or a thread of this process
    (``--disable-frontend-multiprocessing``: an :class:`~fastdeploy.engine.engine.LLMEngine`
    here). Returns what the HTTP layer drives (the process client, or the engine).

    Raises:
        EngineStartError: the engine process could not start (its log says why).
        ValueError, FileNotFoundError, OSError: the engine refused the config.
    """
    if args.disable_frontend_multiprocessing:
        from fastdeploy.engine.engine import LLMEngine

        return LLMEngine(config, plan)
    return EngineCoreProcess(config, plan, args.log_level, num_frontends=args.api_server_count)


def serve_with_engine(args: argparse.Namespace, config: FDConfig, core: Any, serve: ServeFn) -> int:
    """Serve ``core`` with ``serve``: in this process, or with ``--api-server-count N`` in N
    processes sharing one listening socket (:class:`APIServerWorkers` start the others).
    Returns the exit status."""
    count = args.api_server_count
    workers = None
    try:
        if count == 1:
            serve(args, core)
            return 0
        from fastdeploy.entrypoints.openai.api_workers import APIServerWorkers

        try:
            sock = bind_port(args.host, args.port)
        except ValueError as e:
            core.kill()
            print(f"error: {e}", file=sys.stderr)
            return 2
        sock.listen(2048)  # uvicorn's default backlog; every API server process accepts here
        workers = APIServerWorkers(args, config, core.extra_frontends, sock, serve)
        core.release_extra_frontends()
        logger.info("%d API server processes serve %s:%d", count, args.host, sock.getsockname()[1])
        serve(args, core, count=count, sock=sock, workers=workers)
        return 0
    except KeyboardInterrupt:
        # Before uvicorn took the signals (or after it gave them back): nothing is in flight.
        # The engine process would otherwise wait for this process's pipe while this one's
        # exit waits for it.
        print("interrupted while the server was starting", file=sys.stderr)
        if workers is not None:
            workers.stop(5)
        kill = getattr(core, "kill", None)
        if kill is not None:
            kill()
        else:
            core.shutdown()
        return 130


def resolved_config(
    args: argparse.Namespace, config: FDConfig, plan: DeploymentPlan
) -> dict[str, Any]:
    """``{"config", "deployment_plan", "server", "not_supported_yet"}`` for ``--print-config``:
    the same resolved config and deployment plan a started server runs and reports in
    ``/v1/server_info`` (no weights are read).

    ``config`` round-trips through :meth:`fastdeploy.config.FDConfig.from_dict` and
    ``deployment_plan`` through :meth:`fastdeploy.config.DeploymentPlan.from_dict`.
    """
    not_supported = config.not_supported_yet()
    not_supported += server_not_supported(args, config.parallel_config.splitwise_role)
    return {
        "config": config.to_dict(),
        "deployment_plan": plan.to_dict(),
        "server": server_summary(args),
        "not_supported_yet": "; ".join(not_supported) if not_supported else None,
    }


def check_port_free(host: str, port: int, flag: str = "--port") -> None:
    """Bind ``host:port`` once, as uvicorn will, so that a port in use is reported before the
    model loads (port 0, any free port, is not checked). ``flag`` names the option in the error
    (``--port``, or ``--pd-comm-port`` for a PD node's side channel).

    Raises:
        ValueError: the address cannot be bound, naming it and why.
    """
    if port == 0:
        return
    if not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"{flag}={port!r} is invalid; allowed: a TCP port in 1..65535")
    bind_port(host, port, flag).close()


def bind_port(host: str, port: int, flag: str = "--port") -> socket.socket:
    """A TCP socket bound to ``host:port`` as uvicorn binds (``SO_REUSEADDR``), not listening
    yet. ``flag`` names the option in the error.

    Raises:
        ValueError: the address cannot be bound, naming it and why.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        hint = (
            f"another process is listening there; stop it or pick another {flag}"
            if e.errno == errno.EADDRINUSE
            else f"check the host and {flag}"
        )
        raise ValueError(
            f"{flag}={port} is invalid: cannot bind {host}:{port} ({e.strerror}); {hint}"
        ) from None
    return sock


def multiprocess_metrics_dir() -> None:
    """Point ``PROMETHEUS_MULTIPROC_DIR`` of this process and the API server processes it starts
    at a new temporary directory, removed when this process exits (before prometheus_client is
    imported); a directory the variable already names is used and kept, but the ``*.db`` files
    of an earlier run in it are removed (they would be counted again)."""
    given = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if given:
        # A previous server's files there would be summed with this one's.
        stale = [f for f in os.listdir(given) if f.endswith(".db")] if os.path.isdir(given) else []
        for name in stale:
            os.remove(os.path.join(given, name))
        if stale:
            logger.warning(
                "removed %d metrics files of an earlier run from PROMETHEUS_MULTIPROC_DIR=%s",
                len(stale),
                given,
            )
        return
    path = tempfile.mkdtemp(prefix="fastdeploy-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
    atexit.register(shutil.rmtree, path, True)


def run_other_node(config: FDConfig) -> int:
    """``--node-rank K`` with K > 0: run this node's tensor-parallel ranks, which join rank 0
    (node 0's server) at ``--dist-init-addr`` and follow its steps; no HTTP server here. Returns
    0 once rank 0 shut them down, 1 when one of them failed (its traceback is in this log).

    Raises:
        ValueError: a setting not supported yet, or no ``--dist-init-addr``.
    """
    from fastdeploy.distributed.launcher import RankDiedError
    from fastdeploy.worker.executor import run_node

    config.check_supported()
    parallel = config.parallel_config
    logger.info(
        "node %d of %d: running tensor-parallel ranks, rank 0 at %s (no server on this node)",
        parallel.node_rank,
        parallel.nnodes,
        parallel.dist_init_addr,
    )
    try:
        run_node(config)
    except RankDiedError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
