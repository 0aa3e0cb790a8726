"""``fastdeploy router``: one OpenAI-compatible front for PD pairs or plain replicas.

PD mode follows vLLM's ``kv_transfer_params`` protocol (``docs/pd-disaggregation.md``, shared docs):

1. prefill leg: the client's body with ``kv_transfer_params: {"do_remote_decode": true}``,
   ``max_tokens: 1`` and ``stream: false`` to one prefill node, retried on a connection error or a
   503 (on the next healthy node, ``prefill_retries`` times);
2. decode leg: the client's original body plus the ``kv_transfer_params`` the prefill node answered
   with, to one decode node, never retried; its answer is passed through: a stream as it comes,
   JSON once read whole, so a leg that fails after its headers is never a 200 (a 502 or 504, or,
   once a stream's status went out, an error event that ends the stream, counted as an error).
   When it fails before answering, the router sends ABORT to the prefill node's side channel so the
   blocks it holds for the transfer are freed now rather than at lease expiry.

Plain mode forwards each request to one backend. Both modes pass ``X-Request-Id`` (generated when
the client sent none) to every leg and back, serve ``/v1/models``, ``/health`` and ``/metrics``,
and poll each backend's ``/health``.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)

from fastdeploy.entrypoints.openai.auth import APIKeyMiddleware
from fastdeploy.router.config import RouterConfig
from fastdeploy.router.endpoints import (
    Endpoint,
    EndpointPool,
    NoHealthyBackendError,
    poll_health,
)
from fastdeploy.splitwise.pd_auth import PDAuth, set_process_auth
from fastdeploy.splitwise.side_channel import SideChannelError, send_control

logger = logging.getLogger(__name__)

REQUEST_ID = "X-Request-Id"
#: Seconds to wait for a connection to a backend (the legs' own limits come from the config).
CONNECT_TIMEOUT_S = 5.0


class LegError(Exception):
    """A leg failed before the backend answered: answer the client with ``status`` (and the
    backend's ``Retry-After``, when it sent one)."""

    def __init__(self, status: int, message: str, retry_after: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after


#: Backend response headers the router passes on to its client: a 429's or 503's
#: ``Retry-After`` tells the client when to come back (OpenAI clients honour it).
PASSED_HEADERS = ("retry-after",)


def passed_headers(response: httpx.Response) -> dict[str, str]:
    """The :data:`PASSED_HEADERS` a backend's ``response`` carries."""
    return {name: response.headers[name] for name in PASSED_HEADERS if name in response.headers}


def error_response(
    status: int, message: str, request_id: str, retry_after: str | None = None
) -> JSONResponse:
    """An OpenAI-style error body, with the request id header (and ``Retry-After``)."""
    kind = "service_unavailable" if status == 503 else "router_error"
    body = {"error": {"message": message, "type": kind, "param": None, "code": None}}
    headers = {REQUEST_ID: request_id}
    if retry_after is not None:
        headers["Retry-After"] = retry_after
    return JSONResponse(body, status_code=status, headers=headers)


class RouterMetrics:
    """The router's Prometheus metrics, in a registry of its own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "fastdeploy:router_requests",
            "Requests answered by the router, by outcome.",
            ["outcome"],
            registry=self.registry,
        )
        self.retries = Counter(
            "fastdeploy:router_prefill_retries",
            "Prefill legs tried again after a connection error or a 503.",
            registry=self.registry,
        )
        self.aborts = Counter(
            "fastdeploy:router_prefill_aborts",
            "ABORTs sent to a prefill node after its decode leg failed, by result.",
            ["result"],
            registry=self.registry,
        )
        self.leg_seconds = Histogram(
            "fastdeploy:router_leg_seconds",
            "Seconds until a backend answered (headers), by leg.",
            ["leg"],
            registry=self.registry,
        )


def build_router_app(config: RouterConfig, client: httpx.AsyncClient | None = None) -> FastAPI:
    """The router's FastAPI app. Its lifespan starts the health poller (and the HTTP client when
    none is given) and stops them. ``config.api_key``: its clients need one
    (:class:`~fastdeploy.entrypoints.openai.auth.APIKeyMiddleware`; a refusal counts as outcome
    ``unauthorized``); ``config.backend_api_key``: set as the client's ``Authorization`` header,
    so every request to a backend carries it (a given client too).

    Raises:
        ValueError: the PD secret cannot be read or is too short.
    """
    auth = PDAuth.from_secret_file(config.pd_secret_file) if config.is_pd else None
    set_process_auth(auth)  # any send_control in this process signs, passed auth= or not
    if config.is_pd and auth is None:
        logger.warning(
            "no --pd-secret-file or FD_PD_SECRET: the ABORTs this router sends are unsigned "
            "(prefill nodes that have a secret refuse them and free the blocks at lease expiry)"
        )
    if config.is_pd:
        pools = {
            "prefill": EndpointPool("prefill", config.prefill, config.policy),
            "decode": EndpointPool("decode", config.decode, config.policy),
        }
    else:
        pools = {"backend": EndpointPool("backend", config.backend, config.policy)}
    metrics = RouterMetrics()
    state: dict[str, Any] = {"client": client}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        own = state["client"] is None
        if own:
            # No cap on connections to the backends: each carries one client request the router
            # already holds a connection for, so the backends' own limits (--max-concurrency,
            # 429) decide. httpx's default cap (100) queued the rest inside the router, for up
            # to the leg timeout, while the backends had room or would have answered 429.
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
            state["client"] = httpx.AsyncClient(timeout=None, limits=limits)
        if config.backend_api_key is not None:
            state["client"].headers["Authorization"] = f"Bearer {config.backend_api_key}"
        poller = asyncio.create_task(
            poll_health(
                list(pools.values()),
                state["client"],
                config.health_interval_s,
                config.health_failure_threshold,
            )
        )
        try:
            yield
        finally:
            poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await poller
            if own:
                await state["client"].aclose()

    app = FastAPI(title="fastdeploy router", lifespan=lifespan)
    if config.api_key:
        app.add_middleware(
            APIKeyMiddleware,
            keys=config.api_key,
            on_refused=lambda _reason: metrics.requests.labels("unauthorized").inc(),
        )
    app.state.pools = pools
    app.state.metrics = metrics

    @app.get("/health")
    async def health() -> Response:
        if all(p.any_healthy for p in pools.values()):
            return JSONResponse({"status": "ok"})
        down = [p.role for p in pools.values() if not p.any_healthy]
        return JSONResponse({"status": "unavailable", "no_healthy": down}, status_code=503)

    @app.get("/metrics")
    async def metrics_route() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(raw: HTTPRequest) -> Response:
        request_id = raw.headers.get(REQUEST_ID) or uuid.uuid4().hex
        pool = pools["decode" if config.is_pd else "backend"]
        try:
            endpoint = pool.pick()
        except NoHealthyBackendError as e:
            return error_response(503, str(e), request_id)
        try:
            r = await state["client"].get(endpoint.url + "/v1/models", timeout=CONNECT_TIMEOUT_S)
        except httpx.HTTPError as e:
            return error_response(502, f"{endpoint.url}: {type(e).__name__}: {e}", request_id)
        finally:
            pool.release(endpoint)
        return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))

    async def route(raw: HTTPRequest, path: str) -> Response:
        request_id = raw.headers.get(REQUEST_ID) or uuid.uuid4().hex
        try:
            body = await raw.json()
        except ValueError:
            return error_response(400, "the body is not valid JSON", request_id)
        if not isinstance(body, dict):
            return error_response(400, "the body must be a JSON object", request_id)
        router = _Legs(config, pools, state["client"], metrics, request_id, auth)
        try:
            if config.is_pd:
                return await router.pd(path, body)
            return await router.forward(pools["backend"], path, body, "backend")
        except LegError as e:
            metrics.requests.labels("error").inc()
            return error_response(e.status, str(e), request_id, e.retry_after)

    @app.post("/v1/chat/completions")
    async def chat(raw: HTTPRequest) -> Response:
        return await route(raw, "/v1/chat/completions")

    @app.post("/v1/completions")
    async def completions(raw: HTTPRequest) -> Response:
        return await route(raw, "/v1/completions")

    return app


class _Legs:
    """The legs of one client request."""

    def __init__(
        self,
        config: RouterConfig,
        pools: dict[str, EndpointPool],
        client: httpx.AsyncClient,
        metrics: RouterMetrics,
        request_id: str,
        auth: PDAuth | None = None,
    ) -> None:
        self.config, self.pools, self.client = config, pools, client
        self.metrics, self.request_id, self.auth = metrics, request_id, auth

    def _timeout(self, seconds: float) -> httpx.Timeout:
        return httpx.Timeout(seconds, connect=CONNECT_TIMEOUT_S)

    async def _send(
        self, endpoint: Endpoint, path: str, body: dict, timeout_s: float, leg: str
    ) -> httpx.Response:
        """POST ``body``; returns the response with its body not yet read (streamed)."""
        request = self.client.build_request(
            "POST",
            endpoint.url + path,
            # ASCII JSON: a lone surrogate in a string ("\\ud83d") stays an escape for the
            # backend to refuse, instead of failing to encode here.
            content=json.dumps(body).encode(),
            headers={REQUEST_ID: self.request_id, "Content-Type": "application/json"},
            timeout=self._timeout(timeout_s),
        )
        start = time.monotonic()
        response = await self.client.send(request, stream=True)
        self.metrics.leg_seconds.labels(leg).observe(time.monotonic() - start)
        return response

    async def forward(
        self, pool: EndpointPool, path: str, body: dict, leg: str, on_fail=None
    ) -> Response:
        """Send ``body`` to one endpoint of ``pool`` and pass its answer through: an event
        stream as it comes (:meth:`_relay`), any other answer once read whole. ``on_fail`` runs
        when no answer came back, or an error status. Counts the request's outcome in the
        metrics when an answer came back.

        Raises:
            LegError: no healthy endpoint (503), or the connection failed (502) or timed out
                (504) before an answer, or before the end of a non-streamed answer.
        """
        try:
            endpoint = pool.pick()
        except NoHealthyBackendError as e:
            raise LegError(503, str(e)) from e
        try:
            response = await self._send(endpoint, path, body, self.config.decode_timeout_s, leg)
        except httpx.HTTPError as e:
            pool.release(endpoint)
            if isinstance(e, httpx.ConnectError):
                endpoint.healthy = False
            if on_fail is not None:
                await on_fail()
            status = 504 if isinstance(e, httpx.TimeoutException) else 502
            raise LegError(status, f"{leg} {endpoint.url}: {type(e).__name__}: {e}") from e
        if response.status_code >= 400 and on_fail is not None:
            await on_fail()  # the backend refused the leg: nothing will consume what it needed
        headers = {REQUEST_ID: self.request_id, **passed_headers(response)}
        media_type = response.headers.get("content-type")
        if not (media_type or "").startswith("text/event-stream"):
            # A JSON answer is read whole before the client gets a status: a backend that sent
            # its headers and then stalled or died is a 504 or 502, never a 200 with no body.
            try:
                content = await response.aread()
            except httpx.HTTPError as e:
                status = 504 if isinstance(e, httpx.TimeoutException) else 502
                raise LegError(
                    status, f"{leg} {endpoint.url} failed mid-answer: {type(e).__name__}: {e}"
                ) from e
            finally:
                await response.aclose()
                pool.release(endpoint)
            outcome = "ok" if response.status_code < 400 else "backend_error"
            self.metrics.requests.labels(outcome).inc()
            return Response(content, response.status_code, headers=headers, media_type=media_type)
        return StreamingResponse(
            self._relay(response, endpoint, pool, leg),
            status_code=response.status_code,
            headers=headers,
            media_type=media_type,
        )

    async def _relay(self, response: httpx.Response, endpoint: Endpoint, pool, leg: str):
        """Pass a stream through. Its status already went out, so a backend that fails or stalls
        (no byte within ``decode_timeout_s``) mid-stream ends it the way our servers end a failed
        stream (an error event, then ``[DONE]``), and the request counts as an ``error``; a
        client that leaves counts as ``cancelled``."""
        outcome = "cancelled"
        try:
            async for chunk in response.aiter_raw():
                yield chunk
            outcome = "ok" if response.status_code < 400 else "backend_error"
        except httpx.HTTPError as e:
            outcome = "error"
            logger.warning("%s %s failed mid-answer: %r", leg, endpoint.url, e)
            what = "stalled" if isinstance(e, httpx.TimeoutException) else "failed"
            error = {
                "error": {
                    "message": f"{leg} {endpoint.url} {what} mid-stream: {type(e).__name__}: {e}",
                    "type": "router_error",
                    "param": None,
                    "code": None,
                }
            }
            yield f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
        finally:
            self.metrics.requests.labels(outcome).inc()
            await response.aclose()
            pool.release(endpoint)

    async def pd(self, path: str, body: dict) -> Response:
        """Prefill leg, then decode leg with the prefill node's ``kv_transfer_params``."""
        params = await self.prefill(path, body)
        decode_body = copy.deepcopy(body)
        decode_body["kv_transfer_params"] = params

        async def abort() -> None:
            await self.abort_prefill(params)

        return await self.forward(self.pools["decode"], path, decode_body, "decode", abort)

    async def prefill(self, path: str, body: dict) -> dict:
        """Run the prefill leg and return the ``kv_transfer_params`` the node answered with.

        Raises:
            LegError: every try failed (the last status), the node answered an error (its
                status and message), or its answer has no ``kv_transfer_params`` (502).
        """
        leg = copy.deepcopy(body)
        leg["kv_transfer_params"] = {"do_remote_decode": True}
        leg["max_tokens"] = 1
        leg.pop("min_tokens", None)  # the prefill node samples one unconstrained token
        leg.pop("max_completion_tokens", None)
        leg["stream"] = False
        leg.pop("stream_options", None)
        pool = self.pools["prefill"]
        tried: tuple[Endpoint, ...] = ()
        last = LegError(503, "no prefill try was made")
        for attempt in range(self.config.prefill_retries + 1):
            if attempt:
                self.metrics.retries.inc()
            try:
                endpoint = pool.pick(exclude=tried)
            except NoHealthyBackendError as e:
                raise LegError(503, str(e)) from e
            tried += (endpoint,)
            try:
                response = await self._send(
                    endpoint, path, leg, self.config.prefill_timeout_s, "prefill"
                )
                content = await response.aread()
                await response.aclose()
            except httpx.ConnectError as e:
                endpoint.healthy = False
                last = LegError(502, f"prefill {endpoint.url}: {type(e).__name__}: {e}")
                continue
            except httpx.HTTPError as e:
                status = 504 if isinstance(e, httpx.TimeoutException) else 502
                raise LegError(status, f"prefill {endpoint.url}: {type(e).__name__}: {e}") from e
            finally:
                pool.release(endpoint)
            if response.status_code == 503:
                last = LegError(503, f"prefill {endpoint.url} answered 503: {content[:500]!r}")
                continue
            if response.status_code != 200:
                raise LegError(
                    response.status_code,
                    _error_message(content, endpoint.url),
                    response.headers.get("retry-after"),
                )
            try:
                params = httpx.Response(200, content=content).json().get("kv_transfer_params")
            except ValueError:
                params = None
            if not isinstance(params, dict):
                raise LegError(
                    502,
                    f"prefill {endpoint.url} answered without kv_transfer_params; is it started "
                    "with --splitwise-role prefill?",
                )
            return params
        raise last

    async def abort_prefill(self, params: dict) -> None:
        """Best effort: tell the prefill node to free the blocks it holds for this request."""
        host, port = params.get("remote_host"), params.get("remote_port")
        request_id = params.get("remote_request_id")
        if not (host and port and request_id):
            self.metrics.aborts.labels("no_address").inc()
            return
        try:
            # unclaimed_only: a decode node that claimed the blocks (it timed out here while
            # pulling) may still be reading them; it releases them itself.
            await asyncio.to_thread(
                send_control,
                host,
                int(port),
                "ABORT",
                [str(request_id)],
                unclaimed_only=True,
                auth=self.auth,
            )
            self.metrics.aborts.labels("sent").inc()
        except (SideChannelError, ValueError) as e:
            self.metrics.aborts.labels("failed").inc()
            logger.warning("ABORT of %s to %s:%s failed: %s", request_id, host, port, e)


def _error_message(content: bytes, url: str) -> str:
    """The backend's OpenAI-style error message, or its raw body."""
    try:
        message = httpx.Response(200, content=content).json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = content[:500].decode(errors="replace")
    return f"{url}: {message}"
