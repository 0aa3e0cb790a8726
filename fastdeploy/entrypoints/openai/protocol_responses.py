"""Pydantic models of the OpenAI-compatible API's response bodies (chat and completion answers,
streamed chunks, logprobs, usage, models), split from :mod:`fastdeploy.entrypoints.openai.protocol`
(requests). Field names are OpenAI's; responses are lenient models (:class:`OpenAIModel`).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field, model_serializer

from fastdeploy.entrypoints.openai.protocol import OpenAIModel


class PromptTokensDetails(OpenAIModel):
    """OpenAI's ``usage.prompt_tokens_details``: ``cached_tokens`` are the prompt tokens whose KV
    came from the prefix cache (computed for an earlier request), not from this request's
    prefill."""

    cached_tokens: int = 0


class UsageInfo(OpenAIModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class ModelCard(OpenAIModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "fastdeploy"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIModel):
    object: str = "list"
    data: list[ModelCard]


class TopLogprob(OpenAIModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(OpenAIModel):
    content: list[TokenLogprob] | None = None


class CompletionLogprobs(OpenAIModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(OpenAIModel):
    """One token of a ``prompt_logprobs`` entry (vLLM's ``Logprob``): its log-probability, its
    rank (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


#: ``prompt_logprobs`` of a response (vLLM's shape): per prompt token, None for the first, else
#: ``{token id as a string: PromptLogprob}`` holding the prompt token and the top N.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class WithPromptLogprobs(OpenAIModel):
    """A response part that carries ``prompt_logprobs`` only when the request asked for them:
    the key is left out when None, so answers (and streamed chunks, whose templates write the
    same fields) read as before for every other request."""

    prompt_logprobs: PromptLogprobs | None = None

    @model_serializer(mode="wrap")
    def _drop_unasked(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        if data.get("prompt_logprobs", 0) is None:
            del data["prompt_logprobs"]
        return data


class FunctionCall(OpenAIModel):
    name: str
    #: The arguments as a JSON string (OpenAI's form).
    arguments: str


class ToolCall(OpenAIModel):
    """A tool call of an answer: ``id`` is ``chatcmpl-tool-<32 hex>`` (vLLM's form)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(OpenAIModel):
    """The answer's message; ``tool_calls`` is left out when the answer made none."""

    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_no_calls(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        if data.get("tool_calls", 0) is None:
            del data["tool_calls"]
        return data


class ChatChoice(OpenAIModel):
    index: int = 0
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(WithPromptLogprobs):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(OpenAIModel):
    """A streamed message delta; unset fields are left out (as OpenAI does)."""

    role: str | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(OpenAIModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(OpenAIModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class CompletionChoice(WithPromptLogprobs):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(OpenAIModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


def cached_prompt_tokens(num_cached_tokens: int, num_prompt_tokens: int) -> int:
    """The ``cached_tokens`` a usage reports: a request's ``num_cached_tokens`` (its
    ``RequestOutput``'s: whole KV blocks found in the device prefix cache or swapped in from the
    host tier at its first admission, ``Request.reported_cached_tokens``), capped to its prompt.

    Streamed responses take their first output's count and non-streamed ones their finished
    output's; both carry the first admission's count, also for a request preempted by
    recompute (whose re-admission would find its own freed blocks). The cap is a guard: a count
    never exceeds the prompt."""
    return min(num_cached_tokens, num_prompt_tokens)


def usage_of(
    num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int = 0
) -> UsageInfo:
    """A :class:`UsageInfo` with the total and ``prompt_tokens_details.cached_tokens``
    (:func:`cached_prompt_tokens` of ``num_cached_tokens``) filled in. Counts are tokens of one
    request: each prompt counted once, completion tokens summed over every choice (OpenAI's and
    vLLM's usage for ``n > 1`` and batched prompts)."""
    cached = cached_prompt_tokens(num_cached_tokens, num_prompt_tokens)
    return UsageInfo(
        prompt_tokens=num_prompt_tokens,
        completion_tokens=num_completion_tokens,
        total_tokens=num_prompt_tokens + num_completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def dump(model: BaseModel) -> dict[str, Any]:
    """JSON-able dict of a response model."""
    return model.model_dump(mode="json")
