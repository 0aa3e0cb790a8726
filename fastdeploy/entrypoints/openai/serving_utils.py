"""Shared pieces of the serving handlers: OpenAI-style errors, sampling parameters, logprobs,
server-sent events, and collecting a request's output while watching for a client disconnect."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse

from fastdeploy.core.sampling_params import SamplingParams
from fastdeploy.engine.async_engine import EngineDeadError, QueueFullError, RequestStream
from fastdeploy.entrypoints.openai.protocol import (
    CompletionLogprobs,
    ErrorInfo,
    ErrorResponse,
    SamplingFields,
    TokenLogprob,
    TopLogprob,
)

#: Seconds between checks for a disconnected client while a non-streaming request runs.
DISCONNECT_POLL_S = 0.5


class APIError(Exception):
    """An error to answer with ``status`` and an OpenAI-style body."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        """The ``{"error": {...}}`` body."""
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump(mode="json")

    def response(self) -> JSONResponse:
        """The error as a JSON response."""
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    """A 400 ``invalid_request_error``."""
    return APIError(400, message, param=param, code="invalid_value" if param else None)


def param_of(error: ValueError) -> str | None:
    """The field named by a config-style ``ValueError('name=value is invalid; ...')``."""
    match = re.match(r"^(\w+)=", str(error))
    return match.group(1) if match else None


def api_error_from(error: BaseException) -> APIError:
    """Map an engine-side exception to the HTTP error a client should get.

    ``ValueError`` -> 400, :class:`QueueFullError` -> 429 with ``Retry-After``,
    :class:`EngineDeadError` -> 503, anything else -> 500.
    """
    if isinstance(error, QueueFullError):
        return APIError(
            429,
            str(error),
            "rate_limit_error",
            code="rate_limit_exceeded",
            headers={"Retry-After": str(error.retry_after)},
        )
    if isinstance(error, EngineDeadError):
        return APIError(
            503,
            str(error),
            "service_unavailable",
            code="engine_unavailable",
            headers={"Retry-After": "5"},
        )
    if isinstance(error, ValueError):
        return bad_request(str(error), param_of(error))
    return APIError(500, f"internal error: {error!r}", "internal_error")


def _short_json(value: Any) -> str | None:
    """``value`` as short JSON for an error message, or None when it is a container or long."""
    if not isinstance(value, (str, int, float, bool, type(None))):
        return None
    text = json.dumps(value)
    return text if len(text) < 80 else None


def _merge_union_branches(errors: list[dict[str, Any]]) -> list[tuple[list[str], dict]]:
    """``(field path, error)`` pairs with the branches of one union field merged into one.

    Pydantic reports a value that fits no member of ``str | list[str]`` once per member, with the
    member's name appended to the path (``stop.str``, ``stop.list[str]``); clients want one line
    about ``stop``. Branches are recognised as errors on the same parent path and the same input.
    """
    merged: list[tuple[list[str], dict]] = []
    for err in errors:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        prev = merged[-1] if merged else None
        if (
            prev is not None
            and len(loc) > 1
            and err.get("type") != "missing"
            and prev[0][:-1] == loc[:-1]
            and prev[1].get("input") == err.get("input")
            and prev[1].get("type") != "missing"
        ):
            union = prev[1].setdefault("union_members", [prev[0][-1]])
            union.append(loc[-1])
            continue
        merged.append((loc, dict(err)))
    return [(loc[:-1] if "union_members" in e else loc, e) for loc, e in merged]


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """Turn pydantic/FastAPI validation errors into ``(message, first field name)``."""
    parts, first = [], None
    for loc, err in _merge_union_branches(errors):
        kind = err.get("type")
        field = ".".join(loc) if loc else None
        got = _short_json(err.get("input"))
        if kind == "json_invalid":
            ctx = err.get("ctx") or {}
            where = f" at character {loc[0]}" if loc and loc[0].isdigit() else ""
            parts.append(f"malformed JSON body{where}: {ctx.get('error', err.get('msg'))}")
            continue
        if field is None:
            parts.append(
                "the request body must be a JSON object"
                if kind != "missing"
                else "the request body is empty; expected a JSON object"
            )
        elif kind == "extra_forbidden":
            parts.append(f"unknown field {field!r}")
        elif kind == "missing":
            parts.append(f"missing required field {field!r}")
        elif "union_members" in err:
            members = " or ".join(err["union_members"])
            parts.append(f"{field}: expected {members}" + (f" (got {got})" if got else ""))
        else:
            parts.append(f"{field}: {err.get('msg')}" + (f" (got {got})" if got else ""))
        first = first or field
    return "; ".join(parts) or "invalid request body", first


def sampling_params_from(
    req: SamplingFields, max_tokens: int | None, logprobs: int | None
) -> SamplingParams:
    """Build :class:`SamplingParams` from a request's OpenAI fields.

    Defaults follow OpenAI: ``temperature`` and ``top_p`` of 1. ``max_tokens=None`` lets the
    request run until eos or ``max_model_len``.

    Raises:
        APIError: 400 for ``n != 1`` or a value :class:`SamplingParams` rejects (naming it).
    """
    if req.n != 1:
        raise bad_request(f"n={req.n} is not supported; only n=1", "n")
    try:
        return SamplingParams(
            n=1,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            seed=req.seed,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens,
        )
    except ValueError as e:
        raise bad_request(str(e), param_of(e)) from None


def _token_str(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def chat_logprobs(tokenizer: Any, entries: list[dict] | None) -> list[TokenLogprob]:
    """Chat ``logprobs.content`` from engine entries
    ``{"token_id", "logprob", "top_logprobs": [(id, logprob), ...]}``."""
    result = []
    for entry in entries or []:
        token = _token_str(tokenizer, entry["token_id"])
        tops = [
            TopLogprob(
                token=(t := _token_str(tokenizer, tid)), logprob=lp, bytes=list(t.encode("utf-8"))
            )
            for tid, lp in entry.get("top_logprobs") or []
        ]
        result.append(
            TokenLogprob(
                token=token,
                logprob=entry["logprob"],
                bytes=list(token.encode("utf-8")),
                top_logprobs=tops,
            )
        )
    return result


def completion_logprobs(
    tokenizer: Any, entries: list[dict] | None, text_offset_start: int = 0
) -> CompletionLogprobs:
    """Legacy completions ``logprobs`` (tokens, token_logprobs, top_logprobs, text_offset)."""
    out = CompletionLogprobs()
    offset = text_offset_start
    for entry in entries or []:
        token = _token_str(tokenizer, entry["token_id"])
        out.tokens.append(token)
        out.token_logprobs.append(entry["logprob"])
        out.top_logprobs.append(
            {_token_str(tokenizer, tid): lp for tid, lp in entry.get("top_logprobs") or []}
        )
        out.text_offset.append(offset)
        offset += len(token)
    return out


def sse(payload: dict[str, Any] | str) -> str:
    """One server-sent event: ``data: <json>\\n\\n`` (or ``data: [DONE]\\n\\n``)."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


async def collect_final(stream: RequestStream, raw_request: HTTPRequest) -> Any | None:
    """Consume ``stream`` to its last output; abort it and return ``None`` if the client left.

    The client is checked every ``DISCONNECT_POLL_S`` seconds while the request runs (uvicorn
    does not cancel a non-streaming handler when its client goes away).

    Raises:
        What the stream raises (``ValueError`` from the engine, :class:`EngineDeadError`).
    """

    async def consume() -> Any:
        last = None
        async for output in stream:
            last = output
        return last

    consumer = asyncio.ensure_future(consume())
    try:
        while True:
            done, _ = await asyncio.wait({consumer}, timeout=DISCONNECT_POLL_S)
            if done:
                return consumer.result()
            if await raw_request.is_disconnected():
                return None
    finally:
        consumer.cancel()
        stream.close()


async def sse_events(
    steps: AsyncIterator[str], usage_chunk: Callable[[], dict[str, Any] | None]
) -> AsyncIterator[str]:
    """How every stream ends, for both endpoints: the per-step events pass through, an engine
    failure becomes an error event, then the usage chunk (when ``usage_chunk`` returns one) and
    ``[DONE]``. ``steps`` is closed when the client leaves, which aborts its request."""
    async with contextlib.aclosing(steps):
        try:
            async for event in steps:
                yield event
        except Exception as e:  # noqa: BLE001 - report to the client inside the stream
            yield sse(api_error_from(e).body())
            yield sse("[DONE]")
            return
    body = usage_chunk()
    if body is not None:
        yield sse(body)
    yield sse("[DONE]")


async def iterate_closing(stream: RequestStream) -> AsyncIterator[Any]:
    """Iterate ``stream`` and abort it when the consumer stops early (disconnect, cancel)."""
    try:
        async for output in stream:
            yield output
    finally:
        stream.close()


class OpenAIServing:
    """Base of the endpoint handlers: the engine, the served model name, admission."""

    def __init__(self, engine: Any, served_model_name: str) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.served_model_name = served_model_name

    def check_model(self, model: str | None) -> None:
        """Raises :class:`APIError` 404 unless ``model`` is ``None`` or the served name."""
        if model is not None and model != self.served_model_name:
            raise APIError(
                404,
                f"the model {model!r} does not exist; this server serves "
                f"{self.served_model_name!r}",
                param="model",
                code="model_not_found",
            )

    def admit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None,
    ) -> RequestStream:
        """Queue the request; raises :class:`APIError` (400, 429 or 503) when refused."""
        try:
            return self.engine.add_request(request_id, prompt_token_ids, params, prompt)
        except (ValueError, QueueFullError, EngineDeadError) as e:
            reason = (
                "queue_full"
                if isinstance(e, QueueFullError)
                else ("unavailable" if isinstance(e, EngineDeadError) else "invalid")
            )
            self.engine.metrics.observe_rejected(reason)
            raise api_error_from(e) from None
