"""Shared pieces of the serving handlers: sampling parameters and admission (a request's choices
are admitted and collected by :mod:`fastdeploy.entrypoints.openai.choices`, errors built by
:mod:`fastdeploy.entrypoints.openai.errors`, logprobs rendered by
:mod:`fastdeploy.entrypoints.openai.logprobs`, streamed events by
:mod:`fastdeploy.entrypoints.openai.sse`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from fastdeploy.core.detokenizer import TextOffsets, TokenBytes
from fastdeploy.core.sampling_params import SamplingParams, StopLimitError, StopLimits
from fastdeploy.core.structured_output import StructuredOutputsParams
from fastdeploy.entrypoints.engine_client.async_engine import (
    EngineDeadError,
    QueueFullError,
    RequestStream,
)
from fastdeploy.entrypoints.openai.errors import (
    APIError,
    api_error_from,
    bad_request,
    check_context_length,
    param_of,
)
from fastdeploy.entrypoints.openai.protocol import SamplingFields
from fastdeploy.entrypoints.openai.structured_request import structured_outputs_from

T = TypeVar("T")

#: The one thread every handler renders and tokenizes prompts on, one at a time (a fast
#: tokenizer is not safe to share between threads that encode), never on the event loop.
_TOKENIZE = ThreadPoolExecutor(1, thread_name_prefix="fastdeploy-tokenize")

#: Seconds between checks for a disconnected client while a non-streaming request runs (or the
#: first choices of an ``n > 1`` request prefill): :mod:`~fastdeploy.entrypoints.openai.choices`.
DISCONNECT_POLL_S = 0.5


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


def sampling_params_from(
    req: SamplingFields,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    stop_limits: StopLimits | None = None,
    structured_outputs: StructuredOutputsParams | None = None,
) -> SamplingParams:
    """Build :class:`SamplingParams` from a request's OpenAI fields, for one choice (``n`` is
    the handler's: :mod:`~fastdeploy.entrypoints.openai.choices` derives each choice's own).

    Defaults follow OpenAI: ``temperature`` and ``top_p`` of 1. ``max_tokens=None`` lets the
    request run until eos or ``max_model_len``. ``logit_bias`` keys are token ids written as
    strings (OpenAI's form). ``stop_limits``: the server's caps on ``stop`` and
    ``stop_token_ids`` (``--max-stop-strings`` and co; the defaults of :class:`StopLimits` when
    None). ``structured_outputs``: a constraint the handler built (a tool call grammar of
    :mod:`~fastdeploy.entrypoints.openai.tool_request`), used instead of the request's own
    fields (the handler has refused a request that sets both).

    Raises:
        APIError: 400 for a ``logit_bias`` key that is not a token id, stop
            conditions over a cap of ``stop_limits`` (counted as ``stop_limit``), a structured
            output that does not parse (:func:`structured_outputs_from`), or a value
            :class:`SamplingParams` rejects (naming it).
    """
    if prompt_logprobs is None:
        prompt_logprobs = req.prompt_logprobs
    if req.prompt_logprobs is not None and req.stream:
        raise bad_request(
            f"prompt_logprobs={req.prompt_logprobs} is not supported with stream=true; allowed: "
            "null, or stream=false",
            "prompt_logprobs",
        )
    logit_bias = {}
    for key, value in (req.logit_bias or {}).items():
        if not (key.isascii() and key.strip().isdigit()):
            raise bad_request(
                f"logit_bias key {key!r} is invalid; allowed: token ids as strings, e.g. "
                '{"50256": -100}',
                "logit_bias",
            )
        logit_bias[int(key)] = value
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    stop_token_ids = list(req.stop_token_ids or [])
    try:
        (stop_limits or StopLimits()).check(stop, stop_token_ids)
    except StopLimitError as e:
        raise APIError(
            400, str(e), param=e.field, code="invalid_value", reason="stop_limit"
        ) from None
    if structured_outputs is None:
        structured_outputs = structured_outputs_from(req)
    try:
        return SamplingParams(
            n=1,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            seed=req.seed,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop=stop,
            stop_token_ids=stop_token_ids,
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=req.skip_special_tokens,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            frequency_penalty=req.frequency_penalty or 0.0,
            presence_penalty=req.presence_penalty or 0.0,
            logit_bias=logit_bias,
            structured_outputs=structured_outputs,
        )
    except ValueError as e:
        raise bad_request(str(e), param_of(e)) from None


class OpenAIServing:
    """Base of the endpoint handlers: the engine, the served model name, the caps on stop
    conditions (``stop_limits``), admission."""

    def __init__(
        self, engine: Any, served_model_name: str, stop_limits: StopLimits | None = None
    ) -> None:
        self.engine = engine
        self.stop_limits = stop_limits or StopLimits()
        self.tokenizer = engine.tokenizer
        self.served_model_name = served_model_name
        self.token_bytes = TokenBytes(self.tokenizer) if self.tokenizer is not None else None
        self._max_token_chars: int | None = None

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the tokenizing thread: rendering a chat template and encoding a
        long prompt take milliseconds to seconds, during which the event loop would answer
        nobody else."""
        return await asyncio.get_running_loop().run_in_executor(_TOKENIZE, fn, *args)

    def encode(self, text: str, param: str, **kwargs: Any) -> list[int]:
        """Token ids of ``text`` (a prompt, or a rendered conversation), after two checks that
        tokenize nothing: the text is valid Unicode (:func:`check_text`), and it is not longer
        than any prompt that could fit ``max_model_len``. A token stands for at most
        ``max_token_chars`` characters (the longest vocabulary entry), so a text of more than
        twice ``max_model_len * max_token_chars`` characters cannot fit; tokenizing one (an
        18 MB prompt took 9 s on two CPU cores) would only end in the same refusal.

        Raises:
            APIError: 400 on ``param`` (a lone surrogate), or 400 ``context_length_exceeded``
                naming the text's length and the limit.
        """
        check_text(text, param)
        max_model_len = self.engine.max_model_len
        limit = 2 * max_model_len * self.max_token_chars
        if len(text) > limit:
            raise APIError(
                400,
                f"{param} is {len(text)} characters long, more than any text that fits this "
                f"model's maximum context length of {max_model_len} tokens can be (at most "
                f"{limit} characters here); allowed: a prompt of fewer than {max_model_len} tokens",
                param=param,
                code="context_length_exceeded",
            )
        return self.tokenizer.encode(text, **kwargs)

    @property
    def max_token_chars(self) -> int:
        """Characters in the longest entry of the vocabulary (added tokens included): no token
        covers more characters of a text than that."""
        if self._max_token_chars is None:
            self._max_token_chars = max(map(len, self.tokenizer.get_vocab()), default=1)
        return self._max_token_chars

    def text_offsets(self, params: SamplingParams, start: int = 0) -> TextOffsets | None:
        """A fresh :class:`TextOffsets` for one response's output, whose text starts at
        character ``start`` (after an echoed prompt); None without a tokenizer."""
        if self.token_bytes is None:
            return None
        skip = self.tokenizer.all_special_ids if params.skip_special_tokens else ()
        return TextOffsets(self.token_bytes, skip, start)

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
        max_tokens_param: str | None = None,
    ) -> RequestStream:
        """Queue the request; raises :class:`APIError` (400, 429 or 503) when refused, a prompt
        too long for ``max_model_len`` as ``context_length_exceeded`` on ``prompt_param``. (The
        app's error handler counts every refusal in ``fastdeploy:request_rejected_total``.)

        ``max_tokens_param`` names the field the client set ``params.max_tokens`` with; the
        prompt plus that value must then fit ``max_model_len``
        (:func:`~fastdeploy.entrypoints.openai.errors.check_context_length`). None (left out: a
        default that only caps) skips the rule.

        ``req``'s ``kv_transfer_params`` (vLLM's field) make the request a leg of a PD request;
        a prefill leg (``do_remote_decode``) must not stream: its answer carries the params."""
        if max_tokens_param is not None:
            check_context_length(
                len(prompt_token_ids),
                params.max_tokens,
                self.engine.max_model_len,
                prompt_param,
                max_tokens_param,
                getattr(self.engine, "max_model_len_note", None),
            )
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
