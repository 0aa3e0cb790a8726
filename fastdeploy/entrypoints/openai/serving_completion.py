"""``POST /v1/completions``: a text or token-id prompt, JSON or server-sent events.

Without a tokenizer (``--skip-tokenizer-init``) prompts are token ids, and every choice (each
streamed chunk too) carries ``token_ids``, the tokens it adds, since there is no text.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from fastdeploy.core.detokenizer import TextOffsets
from fastdeploy.core.sampling_params import SamplingParams
from fastdeploy.entrypoints.openai.choices import (
    Choice,
    check_n,
    collect_finals,
    merged,
    open_choices,
)
from fastdeploy.entrypoints.openai.errors import APIError, api_error_from, bad_request
from fastdeploy.entrypoints.openai.logprobs import (
    completion_logprobs,
    echo_logprobs,
    vllm_prompt_logprobs,
)
from fastdeploy.entrypoints.openai.protocol import CompletionRequest
from fastdeploy.entrypoints.openai.protocol_responses import (
    CompletionChoice,
    CompletionResponse,
    cached_prompt_tokens,
    dump,
    usage_of,
)
from fastdeploy.entrypoints.openai.serving_utils import (
    OpenAIServing,
    sampling_params_from,
    with_kv_transfer_params,
)
from fastdeploy.entrypoints.openai.sse import (
    ChunkTemplate,
    StreamUsage,
    stream_events,
    to_json,
)


def has_text(prompt: Any) -> bool:
    """Whether a completion's ``prompt`` field holds text (a string, or a list of strings),
    which must be tokenized, rather than token ids."""
    return isinstance(prompt, str) or (
        isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], str)
    )


class OpenAIServingCompletion(OpenAIServing):
    """Handles legacy completions for one served model: one prompt or several, ``n`` choices
    each (:mod:`~fastdeploy.entrypoints.openai.choices`)."""

    def tokenize_prompts(self, req: CompletionRequest) -> list[tuple[str | None, list[int]]]:
        """``[(prompt text or None, prompt token ids)]``, one per prompt: a string or a token-id
        list is one prompt, a list of either holds several (OpenAI's batch).

        Raises:
            APIError: 400 for a text prompt without a tokenizer, or an empty list of prompts.
        """
        prompt: Any = req.prompt
        batch = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))
        prompts = prompt if batch else [prompt]
        result: list[tuple[str | None, list[int]]] = []
        for i, one in enumerate(prompts):
            if isinstance(one, str):
                self.require_tokenizer("a text prompt", "prompt")
                param = f"prompt[{i}]" if batch else "prompt"
                result.append((one, self.encode(one, param)))
            else:
                result.append((None, list(one)))
        return result

    async def create(self, req: CompletionRequest, raw_request: HTTPRequest) -> Response:
        """Run one completion request (every prompt, ``n`` choices each).

        Raises:
            APIError: 400 bad field, 404 unknown model, 429 queue full, 503 engine stopped.
        """
        self.check_model(req.model)
        if req.stream_options is not None and not req.stream:
            raise bad_request(
                "stream_options is only allowed when stream is true", "stream_options"
            )
        self.check_echo(req)
        for name, neutral in (("tools", (None, [])), ("tool_choice", (None, "none", "auto"))):
            if getattr(req, name) not in neutral:
                raise bad_request(
                    f"{name} is not supported on /v1/completions (tool calling is served by "
                    "/v1/chat/completions); allowed here: null",
                    name,
                )
        prompt_logprobs = req.prompt_logprobs
        if req.echo and req.logprobs is not None:  # the echoed prompt's logprobs
            prompt_logprobs = max(prompt_logprobs or 0, req.logprobs)
        # max_tokens=0 (echo, scoring only): one token is generated and left out of the answer.
        max_tokens = 1 if req.max_tokens == 0 else req.max_tokens
        params = sampling_params_from(
            req, max_tokens, req.logprobs, prompt_logprobs, self.stop_limits
        )
        if has_text(req.prompt):
            prompts = await self.off_loop(self.tokenize_prompts, req)
        else:
            # Token ids are only copied: no tokenizer runs, and the tokenizing thread's hop cost
            # a wait for the GIL while the loop streamed other requests (5-6 ms median at 64
            # streams on an H200 host, against 0.06 ms inline).
            prompts = self.tokenize_prompts(req)
        check_n(
            req.n, len(prompts), req.kv_transfer_params, req.best_of,
            getattr(self.engine, "max_concurrency", None),
        )  # fmt: skip
        request_id = f"cmpl-{uuid.uuid4().hex}"
        # Left out, max_tokens is OpenAI's default of 16, a cap that never refuses a request.
        sent = "max_tokens" if "max_tokens" in req.model_fields_set else None

        def admit(rid: str, i: int, choice_params: SamplingParams) -> Any:
            text, ids = prompts[i]
            return self.admit(rid, ids, choice_params, text, "prompt", req, sent)

        try:
            choices = await open_choices(
                admit, request_id, len(prompts), req.n, params, raw_request
            )
        except APIError:
            raise
        except Exception as e:  # noqa: BLE001 - engine-side failure of a first choice
            raise api_error_from(e) from None
        if choices is None:  # the client went away; nobody reads this
            return Response(status_code=499)
        num_prompt_tokens = sum(len(ids) for _, ids in prompts)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(
                self._stream(choices, request_id, num_prompt_tokens, include_usage, params),
                media_type="text/event-stream",
            )
        try:
            finals = await collect_finals(choices, raw_request)
        except Exception as e:  # noqa: BLE001 - engine-side failure of this request
            raise api_error_from(e) from None
        if finals is None:  # the client went away; nobody reads this
            return Response(status_code=499)
        body_choices, num_output_tokens, num_cached = [], 0, 0
        for choice, final in zip(choices, finals):
            first = finals[choice.prompt_index * req.n]  # carries the prompt's logprobs
            text, ids = prompts[choice.prompt_index]
            one, num = self._choice(req, params, text, ids, final, first.prompt_logprobs)
            one.index = choice.index
            body_choices.append(one)
            num_output_tokens += num
            if final is first:
                num_cached += cached_prompt_tokens(final.num_cached_tokens, len(ids))
        body = CompletionResponse(
            id=request_id,
            model=self.served_model_name,
            choices=body_choices,
            usage=usage_of(num_prompt_tokens, num_output_tokens, num_cached),
        )
        return JSONResponse(with_kv_transfer_params(dump(body), finals[0]))

    def _choice(
        self,
        req: CompletionRequest,
        params: SamplingParams,
        prompt: str | None,
        prompt_ids: list[int],
        final: Any,
        prompt_entries: list | None,
    ) -> tuple[CompletionChoice, int]:
        """The choice of a finished request and its output token count: the echoed prompt
        first (``echo``), no generated token for ``max_tokens: 0``, and ``prompt_logprobs`` in
        vLLM's shape when asked. ``prompt_entries``: the engine's prompt logprobs of the prompt
        (its first choice's ``RequestOutput.prompt_logprobs``: the other choices compute none)."""
        comp = final.outputs[0]
        with_logprobs = req.logprobs is not None
        scoring_only = req.max_tokens == 0
        text, token_ids, entries = comp.text, comp.token_ids, comp.logprobs
        if scoring_only:
            text, token_ids, entries = "", [], []
        echoed = ""
        if req.echo:
            echoed = prompt if prompt is not None else self.tokenizer.decode(prompt_ids)
        logprobs = None
        if with_logprobs:
            offsets = self.text_offsets(params, len(echoed))
            if req.echo:
                logprobs = echo_logprobs(
                    self.token_bytes, prompt_ids, prompt_entries, entries, req.logprobs,
                    TextOffsets(self.token_bytes), offsets,
                )  # fmt: skip
            else:
                logprobs = completion_logprobs(self.token_bytes, entries, offsets)
        choice = CompletionChoice(
            text=echoed + text,
            logprobs=logprobs,
            finish_reason="length" if scoring_only else comp.finish_reason,
            prompt_logprobs=vllm_prompt_logprobs(
                self.token_bytes, prompt_entries if req.prompt_logprobs is not None else None
            ),
            **self._token_ids(token_ids),
        )
        return choice, len(token_ids)

    def check_echo(self, req: CompletionRequest) -> None:
        """The rules of ``echo`` and ``max_tokens: 0``.

        Raises:
            APIError: 400 for ``max_tokens: 0`` without ``echo``, ``echo`` with ``stream`` (not
                implemented) or without a tokenizer (the echoed prompt is text).
        """
        if req.max_tokens == 0 and not req.echo:
            raise bad_request(
                "max_tokens=0 is invalid without echo; allowed: an integer >= 1, or 0 with "
                "echo=true (score the prompt only)",
                "max_tokens",
            )
        if req.echo and req.stream:
            raise bad_request(
                "echo=true is not supported with stream=true; allowed: echo=false, or stream=false",
                "echo",
            )
        if req.echo:
            self.require_tokenizer("echo=true (the prompt echoed as text)", "echo")

    def _token_ids(self, token_ids: list[int]) -> dict[str, Any]:
        """``{"token_ids": [...]}`` for a choice when the server has no tokenizer, else ``{}``."""
        return {"token_ids": list(token_ids)} if self.tokenizer is None else {}

    def _stream(
        self,
        choices: list[Choice],
        request_id: str,
        num_prompt_tokens: int,
        include_usage: bool,
        params: SamplingParams,
    ) -> AsyncIterator[str]:
        """Server-sent events: one chunk per step and choice with new text (or new token ids
        without a tokenizer; a choice's last chunk carries its finish reason), an optional usage
        chunk, then ``[DONE]``. Each chunk is a ``CompletionResponse`` with one choice and its
        ``index``, encoded through a :class:`ChunkTemplate`. The usage counts each prompt once
        and sums every choice's tokens; its ``cached_tokens`` are each prompt's first choice's
        first output's
        (:func:`~fastdeploy.entrypoints.openai.protocol_responses.cached_prompt_tokens`)."""
        template = ChunkTemplate(
            request_id, "text_completion", int(time.time()), self.served_model_name
        )
        with_token_ids = self.tokenizer is None
        with_logprobs = params.logprobs is not None
        stream, index_of, firsts = merged(choices)
        usage = StreamUsage(num_prompt_tokens, firsts)
        offsets = {rid: self.text_offsets(params) for rid in index_of}

        def render(ro: Any) -> str:
            usage.count(ro)
            comp = ro.outputs[0]
            logprobs = None
            if with_logprobs:
                logprobs = completion_logprobs(
                    self.token_bytes, comp.delta_logprobs, offsets[ro.request_id]
                )
            news = (
                comp.delta_text
                or (with_token_ids and comp.delta_token_ids)
                or (logprobs and logprobs["tokens"])
            )
            if not (news or ro.finished):
                return ""
            reason = comp.finish_reason if ro.finished else None
            fields = (
                f'"text": {to_json(comp.delta_text)}, "logprobs": {to_json(logprobs)}, '
                f'"finish_reason": {to_json(reason)}'
            )
            if with_token_ids:
                fields += f', "token_ids": {to_json(list(comp.delta_token_ids))}'
            return template.choice(fields, index_of[ro.request_id])

        def closing() -> str:
            return usage.closing(template, include_usage)

        return stream_events(stream, render, closing)
