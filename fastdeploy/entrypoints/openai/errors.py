"""OpenAI-style errors of the server: :class:`APIError` and its body, the mapping from engine-side
exceptions (:func:`api_error_from`), the 400 for pydantic validation errors
(:func:`validation_error`), and the server's own context-length rule for ``max_tokens``
(:func:`check_context_length`)."""

from __future__ import annotations

import json
import re
from typing import Any

from fastapi.responses import JSONResponse

from fastdeploy.core.errors import KVTransferError, KVWaitTimeoutError
from fastdeploy.core.request import InvalidPromptError, PromptTooLongError
from fastdeploy.entrypoints.engine_client.async_engine import EngineDeadError, QueueFullError
from fastdeploy.entrypoints.openai.protocol import ErrorInfo, ErrorResponse

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
    refuses a request (None for a 500, which is not a refusal): the one given, else the one of
    its status (:data:`REJECT_REASON_OF_STATUS`).
    """

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        reason: str | None = None,
    ) -> None:
        super().__init__(message)
        self._reason = reason
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers

    @property
    def reason(self) -> str | None:
        """The rejection reason (see :data:`REJECT_REASON_OF_STATUS`), or None."""
        if self._reason is not None:
            return self._reason
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


def param_of(error: ValueError) -> str | None:
    """The field named by a config-style ``ValueError('name=value is invalid; ...')``."""
    match = re.match(r"^(\w+)=", str(error))
    return match.group(1) if match else None


def api_error_from(error: BaseException, prompt_param: str | None = None) -> APIError:
    """Map an engine-side exception to the HTTP error a client should get.

    :class:`~fastdeploy.core.request.PromptTooLongError` -> 400 ``context_length_exceeded`` on
    ``prompt_param``; :class:`~fastdeploy.core.request.InvalidPromptError` (an empty prompt, a
    token id outside the vocabulary) -> 400 on ``prompt_param``; another ``ValueError`` -> 400 on
    the field it names;
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
    if isinstance(error, InvalidPromptError):
        return bad_request(str(error), prompt_param)
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


def check_context_length(
    num_prompt_tokens: int,
    max_tokens: int | None,
    max_model_len: int,
    prompt_param: str,
    max_tokens_param: str,
    note: str | None = None,
) -> None:
    """The server's rule for an explicit ``max_tokens`` (vLLM's): the prompt plus ``max_tokens``
    must fit ``max_model_len``, so a client asking for more than the model can give hears so
    instead of getting a silently shorter answer. The offline ``LLM`` API has no such rule: there
    ``max_tokens`` is a cap, and generation stops at ``max_model_len`` with ``length``.

    An empty prompt, or one with no room for output, is left to the prompt's own rule
    (:func:`~fastdeploy.core.request.check_prompt_length`, run by the engine's admission check),
    whose message is about the prompt alone. ``max_tokens=None`` (not sent) always passes.

    Args:
        prompt_param, max_tokens_param: the request fields to name (``prompt`` or ``messages``;
            ``max_tokens`` or ``max_completion_tokens``).
        note: why ``max_model_len`` is below the configured value (the engine lowered it to
            the KV cache), or None.

    Raises:
        APIError: 400 ``context_length_exceeded`` on ``max_tokens_param``, naming the context
            length, the prompt's tokens, the value asked for and the largest allowed.
    """
    if max_tokens is None or not 0 < num_prompt_tokens < max_model_len:
        return
    total = num_prompt_tokens + max_tokens
    if total <= max_model_len:
        return
    where = "the messages" if prompt_param == "messages" else "the prompt"
    why = f" ({note})" if note else ""
    raise APIError(
        400,
        f"this model's maximum context length is {max_model_len} tokens{why}, but the request "
        f"asks for {total}: {num_prompt_tokens} in {where} plus {max_tokens_param}={max_tokens}; "
        f"allowed: {max_tokens_param} <= {max_model_len - num_prompt_tokens} for this prompt, or "
        f"leave {max_tokens_param} out to generate up to the context length",
        param=max_tokens_param,
        code="context_length_exceeded",
    )


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
