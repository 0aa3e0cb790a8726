"""Command line of ``fastdeploy router`` (also ``python -m fastdeploy.router``)."""

from __future__ import annotations

import argparse
import logging
import socket
import sys

from fastdeploy import envs
from fastdeploy.entrypoints.openai.auth import resolve_api_keys
from fastdeploy.router.config import POLICIES, RouterConfig


def make_router_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Add the router's flags to ``parser`` (a new one when None) and return it."""
    if parser is None:
        parser = argparse.ArgumentParser(
            prog="python -m fastdeploy.router",
            description="OpenAI-compatible router for prefill/decode pairs or plain replicas",
        )
    parser.add_argument("--host", default="0.0.0.0", help="address to bind (default: 0.0.0.0)")
    parser.add_argument("--port", type=int, default=8000, help="port to bind (default: 8000)")
    parser.add_argument(
        "--prefill", nargs="+", default=[], metavar="URL", help="prefill servers (PD mode)"
    )
    parser.add_argument(
        "--decode", nargs="+", default=[], metavar="URL", help="decode servers (PD mode)"
    )
    parser.add_argument(
        "--backend", nargs="+", default=[], metavar="URL", help="mixed servers (plain mode)"
    )
    parser.add_argument(
        "--policy",
        choices=POLICIES,
        default="round_robin",
        help="how a server is chosen per request (default: round_robin)",
    )
    parser.add_argument(
        "--health-interval-s",
        type=float,
        default=2.0,
        help="seconds between health polls of every server (default: 2)",
    )
    parser.add_argument(
        "--health-failure-threshold",
        type=int,
        default=3,
        help="failed health polls in a row that mark a server unhealthy (default: 3)",
    )
    parser.add_argument(
        "--prefill-timeout-s", type=float, default=300.0, help="limit of the prefill leg"
    )
    parser.add_argument(
        "--decode-timeout-s",
        type=float,
        default=300.0,
        help="limit between two bytes of the decode leg or of a plain request",
    )
    parser.add_argument(
        "--prefill-retries",
        type=int,
        default=2,
        help="further tries of the prefill leg after a connection error or a 503 (default: 2)",
    )
    parser.add_argument(
        "--api-key",
        nargs="+",
        action="extend",
        default=None,
        metavar="KEY",
        help="require 'Authorization: Bearer <KEY>' from the router's clients on every route "
        "but /health and /metrics (as fastdeploy serve --api-key; several keys: any is "
        "accepted); unset, FD_API_KEY, else VLLM_API_KEY (default: none, open)",
    )
    parser.add_argument(
        "--backend-api-key",
        default=None,
        metavar="KEY",
        help="the key the router sends to its backends ('Authorization: Bearer <KEY>', on "
        "every request: both PD legs, /v1/models, health polls): their --api-key; unset, "
        f"{envs.FD_BACKEND_API_KEY.name} (default: none)",
    )
    parser.add_argument(
        "--pd-secret-file",
        default=None,
        metavar="PATH",
        help="file holding the PD nodes' shared secret, to sign ABORTs to prefill nodes "
        "(default: the FD_PD_SECRET environment variable)",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="log level (default: info)",
    )
    return parser


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    """The :class:`RouterConfig` of parsed arguments.

    Raises:
        ValueError: a bad URL, a missing or extra pool, or a bad number (naming it).
    """
    backend_key = args.backend_api_key or envs.FD_BACKEND_API_KEY() or None
    if backend_key is not None:
        resolve_api_keys([backend_key], flag="--backend-api-key")
    return RouterConfig(
        api_key=resolve_api_keys(args.api_key),
        backend_api_key=backend_key,
        prefill=args.prefill,
        decode=args.decode,
        backend=args.backend,
        policy=args.policy,
        health_interval_s=args.health_interval_s,
        health_failure_threshold=args.health_failure_threshold,
        prefill_timeout_s=args.prefill_timeout_s,
        decode_timeout_s=args.decode_timeout_s,
        prefill_retries=args.prefill_retries,
        pd_secret_file=args.pd_secret_file,
    )


def check_port_free(host: str, port: int) -> None:
    """Raise ``OSError`` naming ``host:port`` when it cannot be bound (checked before serving)."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as e:
        raise OSError(f"--port={port} on {host} is not free: {e.strerror}") from None


def run_router(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM; a bad argument prints ``error: ...`` and returns 2."""
    import uvicorn

    from fastdeploy.router.app import build_router_app

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if not 0 <= args.port <= 65535:
        print(f"error: --port={args.port} is invalid; allowed: 0..65535", file=sys.stderr)
        return 2
    try:
        config = config_from_args(args)
        check_port_free(args.host, args.port)
        app = build_router_app(config)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m fastdeploy.router``."""
    return run_router(make_router_parser().parse_args(argv))
