"""Shared pieces of the serving handlers: OpenAI-style errors, sampling parameters, and collecting
a request's output while watching for a client disconnect (logprobs are rendered by
:mod:`fastdeploy.entrypoints.openai.logprobs`, streamed events by
:mod:`fastdeploy.entrypoints.openai.sse`)."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse

from fastdeploy.core.errors import KVTransferError, KVWaitTimeoutError
from fastdeploy.core.request import PromptTooLongError
from fastdeploy.core.sampling_params import SamplingParams
from fastdeploy.engine.async_engine import EngineDeadError, QueueFullError, RequestStream
from fastdeploy.engine.detokenizer import TextOffsets, TokenBytes
from fastdeploy.entrypoints.openai.protocol import ErrorInfo, ErrorResponse, SamplingFields

#: Seconds between checks for a disconnected client while a non-streaming request runs.
DISCONNECT_POLL_S = 0.5


#: ``fastdeploy:request_rejected_total`` reason (:data:`fastdeploy.metrics.REJECT_REASONS`) of
#: each refusal status; a 400 ``context_length_exceeded`` counts as ``context_length``.
REJECT_REASON_OF_STATUS = {
    400: "invalid",
    404: "model_not_found",
    429: "queue_full",
    503: "unavailable",
}


class APIError(Exception):
    """An error to answer with ``status`` and an OpenAI-style body.

    ``reason`` is the label it is counted under in ``fastdeploy:request_rejected_total`` when it
    refuses a request (None for a 500, which is not a refusal).
    """

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

    @property
    def reason(self) -> str | None:
        """The rejection reason (see :data:`REJECT_REASON_OF_STATUS`), or None."""
        if self.code == "context_length_exceeded":
            return "context_length"
        return REJECT_REASON_OF_STATUS.get(self.status)

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


def check_text(text: str, param: str) -> str:
    """``text`` if it can be encoded as UTF-8 (what the tokenizer takes).

    Raises:
        APIError: 400 naming ``param`` when the text holds a lone UTF-16 surrogate (JSON allows
            ``"\\ud83d"`` alone; no tokenizer can encode it).
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad_request(
            f"{param} holds an unpaired UTF-16 surrogate {text[e.start : e.end]!r} at character "
            f"{e.start}; allowed: valid Unicode text",
            param,
        ) from None
    return text


def param_of(error: ValueError) -> str | None:
    """The field named by a config-style ``ValueError('name=value is invalid; ...')``."""
    match = re.match(r"^(\w+)=", str(error))
    return match.group(1) if match else None


def api_error_from(error: BaseException, prompt_param: str | None = None) -> APIError:
    """Map an engine-side exception to the HTTP error a client should get.

    :class:`~fastdeploy.core.request.PromptTooLongError` -> 400 ``context_length_exceeded`` on
    ``prompt_param``; another ``ValueError`` -> 400 on the field it names;
    :class:`QueueFullError` -> 429 with ``Retry-After``; :class:`EngineDeadError` -> 503;
    a failed PD KV transfer (:class:`KVTransferError`) -> 502 ``kv_transfer_failed``; a decode
    node that found no KV blocks in time (:class:`KVWaitTimeoutError`) -> 503; anything else ->
    500.
    """
    if isinstance(error, KVTransferError):
        return APIError(502, str(error), "upstream_error", code="kv_transfer_failed")
    if isinstance(error, KVWaitTimeoutError):
        return APIError(
            503,
            str(error),
            "service_unavailable",
            code="kv_cache_unavailable",
            headers={"Retry-After": "1"},
        )
    if isinstance(error, PromptTooLongError):
        return APIError(400, str(error), param=prompt_param, code="context_length_exceeded")
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
        elif kind == "value_error":  # our own validator's message, without pydantic's prefix
            ctx_error = (err.get("ctx") or {}).get("error")
            parts.append(str(ctx_error) if ctx_error is not None else _strip(err.get("msg")))
        else:
            parts.append(f"{field}: {_strip(err.get('msg'))}" + (f" (got {got})" if got else ""))
        first = first or field
    return "; ".join(parts) or "invalid request body", first


def _strip(message: Any) -> str:
    """A pydantic message without its ``Value error, `` / ``Assertion failed, `` prefix."""
    text = str(message)
    for prefix in ("Value error, ", "Assertion failed, "):
        if text.startswith(prefix):
            return text[len(prefix) :]
    return text


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """The 400 for pydantic/FastAPI validation errors: :func:`validation_message`, with ``param``
    the first field at fault and ``code`` as OpenAI writes them (``unknown_parameter``,
    ``missing_required_parameter``, ``invalid_type``, ``invalid_value``; None for a body that is
    not JSON at all)."""
    message, param = validation_message(errors)
    kinds = {e.get("type") for e in errors}
    if param is None:
        code = None
    elif "extra_forbidden" in kinds:
        code = "unknown_parameter"
    elif "missing" in kinds:
        code = "missing_required_parameter"
    elif any(k and (k.endswith("_type") or k.endswith("_parsing")) for k in kinds):
        code = "invalid_type"
    else:
        code = "invalid_value"
    return APIError(400, message, param=param, code=code)


def sampling_params_from(
    req: SamplingFields, max_tokens: int | None, logprobs: int | None
) -> SamplingParams:
    """Build :class:`SamplingParams` from a request's OpenAI fields.

    Defaults follow OpenAI: ``temperature`` and ``top_p`` of 1. ``max_tokens=None`` lets the
    request run until eos or ``max_model_len``. ``logit_bias`` keys are token ids written as
    strings (OpenAI's form).

    Raises:
        APIError: 400 for ``n != 1``, a ``logit_bias`` key that is not a token id, or a value
            :class:`SamplingParams` rejects (naming it).
    """
    if req.n != 1:
        raise bad_request(f"n={req.n} is not supported; only n=1", "n")
    logit_bias = {}
    for key, value in (req.logit_bias or {}).items():
        if not (key.isascii() and key.strip().isdigit()):
            raise bad_request(
                f"logit_bias key {key!r} is invalid; allowed: token ids as strings, e.g. "
                '{"50256": -100}',
                "logit_bias",
            )
        logit_bias[int(key)] = value
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
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            frequency_penalty=req.frequency_penalty or 0.0,
            presence_penalty=req.presence_penalty or 0.0,
            logit_bias=logit_bias,
        )
    except ValueError as e:
        raise bad_request(str(e), param_of(e)) from None


async def collect_final(stream: RequestStream, raw_request: HTTPRequest) -> Any | None:
    """Consume ``stream`` to its last output; abort it and return ``None`` if the client left.

    The client is checked every ``DISCONNECT_POLL_S`` seconds while the request runs (uvicorn
    does not cancel a non-streaming handler when its client goes away).

    Raises:
        What the stream raises (``ValueError`` from the engine, :class:`EngineDeadError`).
    """
    consumer = asyncio.ensure_future(stream.final())
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


class OpenAIServing:
    """Base of the endpoint handlers: the engine, the served model name, admission."""

    def __init__(self, engine: Any, served_model_name: str) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.served_model_name = served_model_name
        self.token_bytes = TokenBytes(self.tokenizer) if self.tokenizer is not None else None

    def text_offsets(self, params: SamplingParams) -> TextOffsets | None:
        """A fresh :class:`TextOffsets` for one response (None without a tokenizer)."""
        if self.token_bytes is None:
            return None
        skip = self.tokenizer.all_special_ids if params.skip_special_tokens else ()
        return TextOffsets(self.token_bytes, skip)

    def require_tokenizer(self, what: str, param: str) -> None:
        """Raises :class:`APIError` 400 when the server has no tokenizer and ``what`` needs it."""
        if self.tokenizer is None:
            raise bad_request(
                f"{what} needs a tokenizer, and this server runs with --skip-tokenizer-init; "
                "send token ids to /v1/completions",
                param,
            )

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
        prompt_param: str,
        req: SamplingFields | None = None,
    ) -> RequestStream:
        """Queue the request; raises :class:`APIError` (400, 429 or 503) when refused, a prompt
        too long for ``max_model_len`` as ``context_length_exceeded`` on ``prompt_param``. (The
        app's error handler counts every refusal in ``fastdeploy:request_rejected_total``.)

        ``req``'s ``kv_transfer_params`` (vLLM's field) make the request a leg of a PD request;
        a prefill leg (``do_remote_decode``) must not stream: its answer carries the params."""
        kv_params = getattr(req, "kv_transfer_params", None)
        if isinstance(kv_params, dict) and kv_params.get("do_remote_decode") is True and req.stream:
            raise bad_request(
                "kv_transfer_params.do_remote_decode=true is invalid with stream=true; allowed: "
                "stream=false (the prefill leg's answer carries kv_transfer_params)",
                "stream",
            )
        try:
            if kv_params is None:
                return self.engine.add_request(request_id, prompt_token_ids, params, prompt)
            return self.engine.add_request(
                request_id, prompt_token_ids, params, prompt, kv_transfer_params=kv_params
            )
        except (ValueError, QueueFullError, EngineDeadError) as e:
            raise api_error_from(e, prompt_param) from None


def with_kv_transfer_params(body: dict[str, Any], final: Any) -> dict[str, Any]:
    """``body`` plus the top-level ``kv_transfer_params`` of a PD prefill leg's answer (vLLM's
    field), when ``final`` carries them."""
    params = getattr(final, "kv_transfer_params", None)
    if params is not None:
        body["kv_transfer_params"] = params
    return body
