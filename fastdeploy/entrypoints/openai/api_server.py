"""The OpenAI-compatible HTTP server (FastAPI + uvicorn).

Launch with ``fastdeploy serve [args]`` or ``python -m fastdeploy.entrypoints.openai.api_server
[args]`` (same arguments: :func:`make_arg_parser`). Routes: ``GET /v1/models``,
``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /health``, ``GET /metrics``
(Prometheus), ``GET /v1/server_info`` (resolved config, graph plan, live engine stats).

Errors use OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: 400 for malformed
JSON, wrong types, unknown fields and bad values (naming the field), 404 for an unknown model or
route, 429 with ``Retry-After`` when ``--max-concurrency`` requests are in flight, 503 when the
engine loop is stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import uvicorn
from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from fastdeploy.config import FDConfig
from fastdeploy.engine.args_utils import EngineArgs
from fastdeploy.engine.async_engine import AsyncLLMEngine
from fastdeploy.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    dump,
)
from fastdeploy.entrypoints.openai.serving_chat import OpenAIServingChat
from fastdeploy.entrypoints.openai.serving_completion import OpenAIServingCompletion
from fastdeploy.entrypoints.openai.serving_utils import APIError, validation_message

if TYPE_CHECKING:
    from fastdeploy.model_executor.graph_optimization.policy import GraphPlan

logger = logging.getLogger("fastdeploy.api_server")

#: Name served when ``--model`` is not given (the bundled default model).
DEFAULT_SERVED_MODEL_NAME = "SmolLM2-135M-Instruct"


def build_app(
    engine: AsyncLLMEngine, served_model_name: str = DEFAULT_SERVED_MODEL_NAME
) -> FastAPI:
    """The FastAPI app serving ``engine``. Its lifespan starts the engine loop and, on shutdown,
    stops it (in-flight requests fail with 503) and releases the engine."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        logger.info("engine loop started; serving %r", served_model_name)
        try:
            yield
        finally:
            await engine.shutdown()
            logger.info("engine loop stopped")

    app = FastAPI(title="FastDeploy OpenAI-compatible server", lifespan=lifespan)
    chat = OpenAIServingChat(engine, served_model_name)
    completion = OpenAIServingCompletion(engine, served_model_name)

    @app.exception_handler(APIError)
    async def _api_error(_: HTTPRequest, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: HTTPRequest, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(list(exc.errors()))
        engine.metrics.observe_rejected("invalid")
        return APIError(400, message, param=param, code="invalid_value").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: HTTPRequest, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), kind).response()

    @app.exception_handler(Exception)
    async def _internal_error(_: HTTPRequest, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error", exc_info=exc)
        return APIError(500, f"internal error: {exc!r}", "internal_error").response()

    @app.get("/health")
    async def health() -> Response:
        if engine.is_running:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable"}, status_code=503)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        card = ModelCard(
            id=served_model_name, root=served_model_name, max_model_len=engine.max_model_len
        )
        return JSONResponse(dump(ModelList(data=[card])))

    @app.get("/v1/server_info")
    async def server_info() -> JSONResponse:
        core = engine.engine
        return JSONResponse(
            {
                "model": served_model_name,
                "max_model_len": engine.max_model_len,
                "max_concurrency": engine.max_concurrency,
                "config": core.config.to_dict(),
                "graph_plan": core.graph_plan.to_dict(),
                "num_in_flight": engine.num_in_flight,
                "stats": engine.stats,
            }
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw_request: HTTPRequest) -> Response:
        return await chat.create(req, raw_request)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw_request: HTTPRequest) -> Response:
        return await completion.create(req, raw_request)

    return app


class GracefulServer(uvicorn.Server):
    """uvicorn's server, plus: once a shutdown has waited ``grace_s`` seconds for in-flight
    requests, they end with an error (503 or an SSE error event) and are aborted in the engine,
    so their connections close normally instead of being cancelled by uvicorn."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLMEngine, grace_s: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.grace_s = grace_s

    async def shutdown(self, sockets: Any = None) -> None:
        def expire() -> None:
            n = self.engine.fail_in_flight("the server is shutting down")
            if n:
                logger.warning(
                    "ended %d in-flight request(s) after %.0f s of grace", n, self.grace_s
                )

        timer = asyncio.get_running_loop().call_later(self.grace_s, expire)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


def make_arg_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Add the server flags and every ``EngineArgs`` field (``--kebab-case``) to ``parser``.

    Shared by ``fastdeploy serve`` and ``python -m fastdeploy.entrypoints.openai.api_server``.
    """
    if parser is None:
        parser = argparse.ArgumentParser(
            prog="python -m fastdeploy.entrypoints.openai.api_server",
            description="FastDeploy OpenAI-compatible server",
        )
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
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="log level (default: info)",
    )
    EngineArgs.add_cli_args(parser)
    return parser


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
    }
    not_supported = config.not_supported_yet()
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

    A bad argument prints ``error: ...`` to stderr and returns 2.
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
        config, plan = resolve(args)
        if args.print_config:
            print(json.dumps(resolved_config(args, config, plan), indent=2))
            return 0
        from fastdeploy.engine.engine import LLMEngine

        core = LLMEngine(config, plan)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    engine = AsyncLLMEngine(core, max_concurrency=args.max_concurrency)
    app = build_app(engine, served_name(args))
    # uvicorn handles SIGINT/SIGTERM (graceful shutdown, then our lifespan stops the engine) and
    # afterwards re-raises the signal to the handler installed before it ran. This one makes
    # that a normal return, so a signalled server exits 0 instead of dying by the signal.
    stopped_by: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: stopped_by.append(signum))
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        # A backstop only: GracefulServer ends the requests itself when the grace period is over.
        timeout_graceful_shutdown=int(args.timeout_graceful_shutdown) + 5,
    )
    GracefulServer(config, engine, args.timeout_graceful_shutdown).run()
    if stopped_by:
        logger.info("stopped by %s", signal.Signals(stopped_by[0]).name)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m fastdeploy.entrypoints.openai.api_server``."""
    return run_server(make_arg_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
