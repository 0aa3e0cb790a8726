"""The FastAPI app of the OpenAI-compatible server, and the uvicorn server that runs it.

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``,
``GET /health`` (503 when the engine loop stopped, or stalled: ``--engine-stall-timeout``) and
its alias ``GET|POST /ping`` (vLLM's), ``GET /metrics`` (Prometheus), ``GET /v1/server_info``
(resolved config, deployment plan, live engine stats), and vLLM's ``POST /tokenize``,
``POST /detokenize``, ``GET /version``, ``GET /v1/models/{model_id}``
(:mod:`~fastdeploy.entrypoints.openai.serving_tokenization`).

Errors use OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: 400 for malformed
JSON, wrong types, unknown fields and bad values (naming the field in ``param``), 400
``context_length_exceeded`` for a prompt with no room for output or a ``max_tokens`` past
``max_model_len`` (:func:`~fastdeploy.entrypoints.openai.errors.check_context_length`), 404 for an
unknown model or route, 429 with ``Retry-After`` when ``--max-concurrency`` requests are in flight,
503 when the engine loop is stopped. Every refusal of a request is counted in
``fastdeploy:request_rejected_total`` by reason (``invalid``, ``context_length``,
``model_not_found``, ``queue_full``, ``unavailable``, ``stop_limit``), in one place: the error
handlers below; refusals made before the app runs are counted where they are made: the request
limits' (:mod:`~fastdeploy.entrypoints.openai.limits`: 431, 413, 408) and a missing or wrong
``--api-key``'s (:mod:`~fastdeploy.entrypoints.openai.auth`: 401).
On a PD decode node a refused decode leg also releases the prefill node's blocks there, if the
leg names a prefill node this node trusts
(:meth:`~fastdeploy.engine.admission.Admission.release_refused_leg`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from fastdeploy.core.sampling_params import StopLimits
from fastdeploy.entrypoints.engine_client.async_engine import AsyncLLMEngine
from fastdeploy.entrypoints.openai.auth import APIKeyMiddleware, mask
from fastdeploy.entrypoints.openai.errors import APIError, bad_request, validation_error
from fastdeploy.entrypoints.openai.limits import HTTPLimits, RequestLimitsMiddleware
from fastdeploy.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from fastdeploy.entrypoints.openai.protocol_responses import ModelList, dump
from fastdeploy.entrypoints.openai.serving_chat import OpenAIServingChat
from fastdeploy.entrypoints.openai.serving_completion import OpenAIServingCompletion
from fastdeploy.entrypoints.openai.serving_tokenization import add_fleet_routes, model_card
from fastdeploy.entrypoints.openai.tool_config import ToolServingConfig
from fastdeploy.entrypoints.server_args import DEFAULT_SERVED_MODEL_NAME

logger = logging.getLogger("fastdeploy.api_server")


def build_app(
    engine: AsyncLLMEngine,
    served_model_name: str = DEFAULT_SERVED_MODEL_NAME,
    before_shutdown: Callable[[], Awaitable[None]] | None = None,
    api_server: tuple[int, int] = (0, 1),
    limits: HTTPLimits | None = None,
    stop_limits: StopLimits | None = None,
    api_keys: Sequence[str] = (),
    tool_config: ToolServingConfig | None = None,
) -> FastAPI:
    """The FastAPI app serving ``engine``. Its lifespan starts the engine loop and, on shutdown,
    awaits ``before_shutdown`` (the first of several API server processes waits for the others
    there), then stops the loop (in-flight requests fail with 503) and releases the engine.
    ``api_server``: this process's index and the number of API server processes
    (``/v1/server_info``). ``limits``: the header count, body size and body read timeout
    (:class:`RequestLimitsMiddleware`; the header size and header read timeout are the uvicorn
    protocol's, :meth:`HTTPLimits.uvicorn_kwargs`); defaults when None. ``stop_limits``: the
    caps on ``stop`` and ``stop_token_ids``. ``api_keys``: when any, every route but
    :data:`~fastdeploy.entrypoints.openai.auth.OPEN_PATHS` needs one (:class:`APIKeyMiddleware`).
    ``tool_config``: the tool flags (:class:`ToolServingConfig`; defaults when None)."""
    limits = limits or HTTPLimits()
    stop_limits = stop_limits or StopLimits()

    def count_refusal(reason: str) -> None:
        engine.metrics.observe_rejected(reason)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        logger.info("engine loop started; serving %r", served_model_name)
        try:
            yield
        finally:
            if before_shutdown is not None:
                await before_shutdown()
            await engine.shutdown()
            logger.info("engine loop stopped")

    app = FastAPI(title="FastDeploy OpenAI-compatible server", lifespan=lifespan)
    # The last added runs first: the key is checked before a body is read.
    app.add_middleware(RequestLimitsMiddleware, limits=limits, on_refused=count_refusal)
    if api_keys:
        app.add_middleware(APIKeyMiddleware, keys=list(api_keys), on_refused=count_refusal)
    chat = OpenAIServingChat(engine, served_model_name, stop_limits, tool_config)
    completion = OpenAIServingCompletion(engine, served_model_name, stop_limits)

    def refuse(error: APIError, body: Any = None) -> JSONResponse:
        if error.reason is not None:
            engine.metrics.observe_rejected(error.reason)
            if isinstance(body, dict) and engine.splitwise_role == "decode":
                # A refused decode leg: nobody will pull the prefill node's blocks for it.
                engine.release_refused_leg(body.get("kv_transfer_params"))
        return error.response()

    async def refusing(create: Callable[[], Awaitable[Response]], req: Any) -> Response:
        """Run a request's handler; a refusal it raises (a 4xx or 503 before the engine took
        the request, or the engine's own error for it: ABORT is idempotent) is answered here,
        with the request's ``kv_transfer_params`` at hand."""
        try:
            return await create()
        except APIError as e:
            return refuse(e, {"kv_transfer_params": getattr(req, "kv_transfer_params", None)})

    @app.exception_handler(APIError)
    async def _api_error(_: HTTPRequest, exc: APIError) -> JSONResponse:
        return refuse(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: HTTPRequest, exc: RequestValidationError) -> JSONResponse:
        ctype = request.headers.get("content-type", "")
        mime = ctype.split(";")[0].strip().lower()
        if ctype and mime != "application/json" and not mime.endswith("+json"):
            # FastAPI did not read the body as JSON at all (curl -d sends a form by default).
            return refuse(
                bad_request(
                    f"Content-Type {ctype!r} is not supported; allowed: application/json (with "
                    f"a JSON object body)"
                )
            )
        return refuse(validation_error(list(exc.errors())), exc.body)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: HTTPRequest, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), kind).response()

    @app.exception_handler(Exception)
    async def _internal_error(_: HTTPRequest, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error", exc_info=exc)
        return APIError(500, f"internal error: {exc!r}", "internal_error").response()

    @app.get("/health")
    @app.api_route("/ping", methods=["GET", "POST"])  # vLLM's SageMaker alias of /health
    async def health() -> Response:
        if not engine.is_running:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        stalled = engine.stall_reason()  # alive, but no step ends (--engine-stall-timeout)
        if stalled is not None:
            return JSONResponse({"status": "stalled", "reason": stalled}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(dump(ModelList(data=[model_card(engine, served_model_name)])))

    add_fleet_routes(app, chat)  # /tokenize, /detokenize, /version, /v1/models/{model_id}

    stop_limits_dict = {k: v for k, v in dataclasses.asdict(stop_limits).items() if k != "flags"}

    @app.get("/v1/server_info")
    async def server_info() -> JSONResponse:
        described = engine.describe()
        return JSONResponse(
            {
                "model": served_model_name,
                "max_model_len": engine.max_model_len,
                "max_model_len_note": engine.max_model_len_note,
                "max_concurrency": engine.max_concurrency,
                "api_server": {"index": api_server[0], "count": api_server[1], "pid": os.getpid()},
                "engine_pid": engine.engine_pid,
                "api_key": mask(api_keys),
                "limits": {**dataclasses.asdict(limits), **stop_limits_dict},
                "config": described.get("config"),
                "deployment_plan": described.get("deployment_plan"),
                "num_in_flight": engine.num_in_flight,
                "stats": engine.stats,
            }
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw_request: HTTPRequest) -> Response:
        return await refusing(lambda: chat.create(req, raw_request), req)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw_request: HTTPRequest) -> Response:
        return await refusing(lambda: completion.create(req, raw_request), req)

    return app


class GracefulServer(uvicorn.Server):
    """uvicorn's server, plus: once a shutdown has waited ``grace_s`` seconds for in-flight
    requests, they end with an error (503 or an SSE error event) and are aborted in the engine,
    so their connections close normally instead of being cancelled by uvicorn.

    ``on_shutdown`` is called as the shutdown starts (the first API server process stops the
    others then)."""

    def __init__(
        self,
        config: uvicorn.Config,
        engine: AsyncLLMEngine,
        grace_s: float,
        on_shutdown: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(config)
        self.engine = engine
        self.grace_s = grace_s
        self.on_shutdown = on_shutdown

    async def shutdown(self, sockets: Any = None) -> None:
        if self.on_shutdown is not None:
            self.on_shutdown()

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


def check_http_stack() -> list[str]:
    """The fast parts of uvicorn's stack that are missing: ``"uvloop"`` (its event loop) and
    ``"httptools"`` (its HTTP/1.1 parser), which uvicorn uses when they are installed
    (``loop="auto"``, ``http="auto"``), falling back to asyncio's loop and h11. Without both the
    server's asyncio thread spent about 40% more CPU per streamed token (17 against 12 us on a
    2-core x86 VM, ``benchmarks/benchmark_server_overhead.py``), and that thread serves every
    stream of the process; without httptools alone the H200 served row was about 1% slower.
    Logs a warning naming the missing ones and the fix; returns them."""
    import importlib.util

    fallback = {"uvloop": "asyncio's event loop", "httptools": "h11"}
    missing = [name for name in fallback if importlib.util.find_spec(name) is None]
    if missing:
        logger.warning(
            "%s not installed: uvicorn falls back to %s, which costs the server more CPU per "
            "streamed token (pip install %s)",
            " and ".join(missing),
            " and ".join(fallback[name] for name in missing),
            " ".join(missing),
        )
    return missing
