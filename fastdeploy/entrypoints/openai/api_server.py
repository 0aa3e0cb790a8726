"""The OpenAI-compatible server's command line (FastAPI + uvicorn; the app is in
:mod:`fastdeploy.entrypoints.openai.app`).

Launch with ``fastdeploy serve [args]`` or ``python -m fastdeploy.entrypoints.openai.api_server
[args]`` (same arguments: :func:`make_arg_parser`). Start-up checks everything it can before the
model loads (arguments, the device, the port), and a bad one prints one ``error: ...`` line and
exits with status 2. ``--print-config`` imports neither the web stack nor the model code it does
not need.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import dataclasses
import errno
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
from typing import TYPE_CHECKING, Any

from fastdeploy import envs
from fastdeploy.config import FDConfig
from fastdeploy.core.sampling_params import DEFAULT_STOP_LIMITS, MAX_STOP_LIMITS, StopLimits
from fastdeploy.engine.args_utils import EngineArgs
from fastdeploy.entrypoints.engine_client.stall_watch import (
    DEFAULT_ENGINE_STALL_TIMEOUT_S,
    check_stall_timeout,
)
from fastdeploy.entrypoints.openai.auth import mask, resolve_api_keys
from fastdeploy.entrypoints.openai.limits import HTTPLimits

if TYPE_CHECKING:
    from fastdeploy.model_executor.graph_optimization.policy import GraphPlan

logger = logging.getLogger("fastdeploy.api_server")

#: Name served when ``--model`` is not given (the bundled default model).
DEFAULT_SERVED_MODEL_NAME = "SmolLM2-135M-Instruct"


def make_arg_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Add the server flags and every ``EngineArgs`` field (``--kebab-case``) to ``parser``.

    Shared by ``fastdeploy serve`` and ``python -m fastdeploy.entrypoints.openai.api_server``.
    """
    if parser is None:
        parser = argparse.ArgumentParser(
            prog="python -m fastdeploy.entrypoints.openai.api_server",
            description="FastDeploy OpenAI-compatible server",
        )
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = env_help()
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="0.0.0.0", help="address to bind (default: 0.0.0.0)")
    server.add_argument("--port", type=_port, default=8000, help="port to bind (default: 8000)")
    server.add_argument(
        "--served-model-name",
        default=None,
        help="model name clients send (default: --model, or "
        f"{DEFAULT_SERVED_MODEL_NAME} for the bundled model)",
    )
    server.add_argument(
        "--max-concurrency",
        type=int,
        default=512,
        help="requests in flight at once (running + waiting); more are refused "
        "with 429 and Retry-After (default: 512)",
    )
    server.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved configuration and graph plan as JSON and exit "
        "without loading weights",
    )
    server.add_argument(
        "--timeout-graceful-shutdown",
        type=float,
        default=10,
        help="seconds in-flight requests may run on after SIGINT/SIGTERM before they are "
        "cancelled (aborted, their KV blocks freed) (default: 10)",
    )
    server.add_argument(
        "--disable-frontend-multiprocessing",
        action="store_true",
        help="run the engine loop on a thread of the server process instead of a process of "
        "its own (one GIL: slower when the model's step is host-bound)",
    )
    server.add_argument(
        "--api-server-count",
        type=int,
        default=1,
        help="API server processes serving the port, all in front of one engine process "
        "(vLLM's flag): spreads the HTTP and SSE work of many concurrent streams over more "
        "cores; --max-concurrency is shared out among them (default: 1)",
    )
    server.add_argument(
        "--engine-stall-timeout",
        type=float,
        default=DEFAULT_ENGINE_STALL_TIMEOUT_S,
        help="seconds the engine may go without finishing a step while it has work before "
        "/health answers 503 (stalled; 200 again when steps resume); 0: never. Raise it for "
        "long CPU steps: 8,192 prompt tokens in one step can take minutes there "
        f"(default: {DEFAULT_ENGINE_STALL_TIMEOUT_S:g})",
    )
    server.add_argument(
        "--api-key",
        nargs="+",
        action="extend",
        default=None,
        metavar="KEY",
        help="require 'Authorization: Bearer <KEY>' on every route but /health and /metrics "
        "(vLLM's flag; several keys: any is accepted); unset, FD_API_KEY, else VLLM_API_KEY "
        "(the environment keeps the key out of the process list) (default: none, open)",
    )
    limits = parser.add_argument_group(
        "request limits", "each refusal is counted in fastdeploy:request_rejected_total"
    )
    limits.add_argument(
        "--h11-max-header-count",
        type=_positive(int),
        default=HTTPLimits.max_header_count,
        help="headers in one request; more: 431 (vLLM's flag; here with httptools too) "
        f"(default: {HTTPLimits.max_header_count})",
    )
    limits.add_argument(
        "--h11-max-incomplete-event-size",
        type=_positive(int),
        default=HTTPLimits.max_header_bytes,
        help="bytes of a request's line and headers; more: 431 (vLLM's flag; here with "
        f"httptools too) (default: {HTTPLimits.max_header_bytes})",
    )
    limits.add_argument(
        "--max-request-body-bytes",
        type=_positive(int),
        default=HTTPLimits.max_body_bytes,
        help=f"bytes of a request body; more: 413 (default: {HTTPLimits.max_body_bytes})",
    )
    limits.add_argument(
        "--request-read-timeout",
        type=_positive(float),
        default=HTTPLimits.read_timeout_s,
        help="seconds a request's headers may take to arrive, and again its body; later: 408 "
        f"and the connection is closed (default: {HTTPLimits.read_timeout_s:g})",
    )
    for name, default, ceiling, what in zip(
        ("--max-stop-strings", "--max-stop-chars", "--max-stop-token-ids"),
        DEFAULT_STOP_LIMITS,
        MAX_STOP_LIMITS,
        ("stop strings", "characters in all stop strings", "stop_token_ids"),
    ):
        limits.add_argument(
            name,
            type=_positive(int),
            default=default,
            help=f"{what} of one request, at most {ceiling}; more: 400 (default: {default})",
        )
    server.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="log level (default: info)",
    )
    EngineArgs.add_cli_args(parser)
    return parser


def env_help() -> str:
    """The ``--help`` epilog: every ``FD_*`` environment variable, its default and meaning."""
    import textwrap

    lines = ["environment variables:"]
    for var in envs.describe():
        lines.append(f"  {var.name} (default: {var.default})")
        lines += textwrap.wrap(var.doc, 76, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(lines)


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


def served_name(args: argparse.Namespace) -> str:
    """``--served-model-name``, else ``--model`` as given, else the bundled model's name."""
    return args.served_model_name or args.model or DEFAULT_SERVED_MODEL_NAME


def _port(text: str) -> int:
    """argparse type of ``--port``: an integer in 0..65535."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"--port={text!r} is invalid; allowed: 0..65535")
    return port


def _positive(kind: type) -> Any:
    """argparse type: a number of ``kind`` > 0."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = 0
        if not value > 0:
            what = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"{text!r} is invalid; allowed: {what} > 0")
        return value

    parse.__name__ = kind.__name__
    return parse


def request_limits(args: argparse.Namespace) -> tuple[HTTPLimits, StopLimits]:
    """The request limits of the server's flags.

    Raises:
        ValueError: a limit out of range, naming its flag.
    """
    try:
        http = HTTPLimits(
            max_header_count=args.h11_max_header_count,
            max_header_bytes=args.h11_max_incomplete_event_size,
            max_body_bytes=args.max_request_body_bytes,
            read_timeout_s=args.request_read_timeout,
        )
        stop = StopLimits(args.max_stop_strings, args.max_stop_chars, args.max_stop_token_ids)
    except ValueError as e:
        name, _, rest = str(e).partition("=")
        raise ValueError(f"--{name.replace('_', '-')}={rest}") from None
    return http, stop


def resolved_config(args: argparse.Namespace, config: FDConfig, plan: GraphPlan) -> dict[str, Any]:
    """``{"config", "graph_plan", "server", "not_supported_yet"}`` for ``--print-config``: the
    same resolved config and plan a started server would run (no weights are read).

    ``config`` round-trips through :meth:`fastdeploy.config.FDConfig.from_dict`.
    """
    server = {
        "host": args.host,
        "port": args.port,
        "served_model_name": served_name(args),
        "max_concurrency": args.max_concurrency,
        "engine_process": not args.disable_frontend_multiprocessing,
        "api_server_count": args.api_server_count,
        "engine_stall_timeout": args.engine_stall_timeout,
        "api_key": mask(getattr(args, "api_key", None)),
    }
    http_limits, stop_limits = request_limits(args)
    server["limits"] = {
        **dataclasses.asdict(http_limits),
        **{k: v for k, v in dataclasses.asdict(stop_limits).items() if k != "flags"},
    }
    not_supported = config.not_supported_yet()
    role = config.parallel_config.splitwise_role
    if args.api_server_count > 1 and role != "mixed":
        not_supported.append(
            f"--api-server-count={args.api_server_count} with --splitwise-role={role} is not "
            "supported yet; allowed there: 1"
        )
    return {
        "config": config.to_dict(),
        "graph_plan": plan.to_dict(),
        "server": server,
        "not_supported_yet": "; ".join(not_supported) if not_supported else None,
    }


def resolve(args: argparse.Namespace) -> tuple[FDConfig, GraphPlan]:
    """Resolve the server's arguments once: ``EngineArgs`` -> validated :class:`FDConfig`
    (model source, device and attention backend decided) -> the graph plan.

    Raises:
        ValueError: a bad argument; FileNotFoundError: the model does not exist.
    """
    from fastdeploy.model_executor.graph_optimization.policy import resolve_graph_plan

    config = EngineArgs.from_cli_args(args).create_engine_config()
    return config, resolve_graph_plan(config)


def run_server(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM (or print the config); returns the exit status.

    A bad argument, a port in use or a device this machine lacks prints one ``error: ...`` line
    to stderr and returns 2, before the model loads.
    """
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.max_concurrency < 1:
        print(
            f"error: --max-concurrency={args.max_concurrency} is invalid; allowed: an integer >= 1",
            file=sys.stderr,
        )
        return 2
    try:
        check_stall_timeout(args.engine_stall_timeout)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    count = args.api_server_count
    if count < 1 or count > args.max_concurrency:
        print(
            f"error: --api-server-count={count} is invalid; allowed: 1..--max-concurrency "
            f"({args.max_concurrency})",
            file=sys.stderr,
        )
        return 2
    if count > 1 and args.disable_frontend_multiprocessing:
        print(
            f"error: --api-server-count={count} is invalid with "
            "--disable-frontend-multiprocessing (the API server processes share an engine "
            "process); allowed: 1",
            file=sys.stderr,
        )
        return 2
    if count > 1 and not args.print_config:
        _multiprocess_metrics_dir()  # before anything imports prometheus_client
    try:
        # Resolved once, here: the API server processes after the first get these args.
        args.api_key = resolve_api_keys(args.api_key) or None
        request_limits(args)
        if not args.print_config:  # fail fast, before the model's config is even read
            from fastdeploy.engine.engine import check_device_available

            engine_args = EngineArgs.from_cli_args(args)
            check_device_available(engine_args.resolve_device())
            envs.FD_GC_FREEZE()  # used after start-up: a bad value fails here, before the load
            if engine_args.node_rank == 0:  # other nodes serve nothing
                check_port_free(args.host, args.port)
            if engine_args.splitwise_role != "mixed" and engine_args.pd_comm_port:
                if engine_args.pd_comm_port == args.port:
                    raise ValueError(
                        f"--pd-comm-port={args.port} is invalid: it is also --port; allowed: "
                        "another port"
                    )
                check_port_free(engine_args.pd_host, engine_args.pd_comm_port, "--pd-comm-port")
        config, plan = resolve(args)
        if args.print_config:
            print(json.dumps(resolved_config(args, config, plan), indent=2))
            return 0
        if config.parallel_config.node_rank > 0:
            return run_other_node(config)
        role = config.parallel_config.splitwise_role
        if count > 1 and role != "mixed":
            raise ValueError(
                f"--api-server-count={count} is not supported yet with --splitwise-role={role}; "
                "allowed there: 1"
            )
        if args.disable_frontend_multiprocessing:
            from fastdeploy.engine.engine import LLMEngine

            core = LLMEngine(config, plan)
        else:
            from fastdeploy.entrypoints.engine_client.process_client import (
                EngineCoreProcess,
                EngineStartError,
            )

            try:
                core = EngineCoreProcess(config, plan, args.log_level, num_frontends=count)
            except EngineStartError as e:
                print(f"error: {e}", file=sys.stderr)
                return 1
            except KeyboardInterrupt:  # the engine process was killed on the way out
                print("interrupted while the engine was starting", file=sys.stderr)
                return 130
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
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
        workers = APIServerWorkers(args, config, core.extra_frontends, sock)
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
    )
    # uvicorn handles SIGINT/SIGTERM (graceful shutdown, then our lifespan stops the engine) and
    # afterwards re-raises the signal to the handler installed before it ran. This one makes
    # that a normal return, so a signalled server exits 0 instead of dying by the signal; a
    # signal before uvicorn has started raises KeyboardInterrupt (run_server stops the engine).
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
    freeze_startup_heap("api server", envs.FD_GC_FREEZE())  # full collections skip it
    server.run(sockets=[sock] if sock is not None else None)
    if stopped_by:
        logger.info("stopped by %s", signal.Signals(stopped_by[0]).name)


def _multiprocess_metrics_dir() -> None:
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


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m fastdeploy.entrypoints.openai.api_server``."""
    return run_server(make_arg_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
