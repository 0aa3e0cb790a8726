"""Pydantic models of the OpenAI-compatible API: request bodies, errors and the tokenizer routes
(response bodies: :mod:`fastdeploy.entrypoints.openai.protocol_responses`).

Field names are OpenAI's. Requests are strict: a wrong type is an error (``"10"`` is not an integer)
and an unknown field is an error naming it, rather than being silently dropped; both become a 400
with an OpenAI-style error body (see :mod:`fastdeploy.entrypoints.openai.serving_utils`). A few
widely used extensions (``top_k``, ``ignore_eos``, ``min_tokens``, ``stop_token_ids``,
``skip_special_tokens``, ``repetition_penalty``) follow vLLM / FastDeploy. Value ranges of the
sampling fields are checked once, by :class:`~fastdeploy.core.sampling_params.SamplingParams`.

Routers. ``vllm-router`` (0.1.x) and ``sglang-router`` (0.3.x) parse the body into their own typed
request and serialize it again, so every field that they type as a plain ``bool`` reaches us even
when the client left it out. Measured with both routers in front of a server that logs bodies:

* chat, both: ``logprobs``, ``stream``, ``no_stop_trim``, ``ignore_eos``,
  ``continue_final_message``, ``skip_special_tokens``, ``separate_reasoning``,
  ``stream_reasoning``, ``return_hidden_states``; ``vllm-router`` adds ``include_reasoning``;
* completions, both: ``stream``, ``echo``, ``no_stop_trim``, ``ignore_eos``,
  ``skip_special_tokens``, ``return_hidden_states``;
* ``vllm-router``'s PD prefill leg adds ``max_tokens: 1``, ``min_tokens: 1`` and
  ``kv_transfer_params`` (:attr:`SamplingFields.kv_transfer_params`).

These are accepted at the values that change nothing here (:data:`NEUTRAL_ONLY`, and the reasoning
flags of :class:`ChatCompletionRequest`) and refused otherwise, naming the field and the allowed
value. Fields a router forwards only when the client sent them (SGLang's ``rid``, ``lora_path``,
``session_params``, ``regex``) stay unknown fields: none has a neutral value worth a knob here.
So do ``bootstrap_host`` / ``bootstrap_port`` / ``bootstrap_room``, which ``sglang-router`` adds to
both legs in its PD mode: they belong to SGLang's own PD protocol, which this server does not speak.
"""

from __future__ import annotations

import json
import math
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
)


class StrictModel(BaseModel):
    """Base of request bodies: strict types, unknown fields rejected."""

    model_config = ConfigDict(strict=True, extra="forbid")


class OpenAIModel(BaseModel):
    """Base of response bodies."""

    model_config = ConfigDict(extra="allow")


# ------------------------------------------------------------------------------------ errors
class ErrorInfo(OpenAIModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(OpenAIModel):
    error: ErrorInfo


# ------------------------------------------------------------------------------------ requests
#: Largest ``temperature`` a request may ask for (OpenAI's limit; the offline API has none).
MAX_TEMPERATURE = 2.0

#: Router-added fields accepted only at the value that changes nothing, ``{field: allowed}``; one
#: rule for both endpoints (:meth:`SamplingFields._neutral_only`).
NEUTRAL_ONLY: dict[str, bool] = {
    # SGLang: keep the stop string in the output. We always trim it.
    "no_stop_trim": False,
    # SGLang: answer hidden states. We have none to give.
    "return_hidden_states": False,
    # vLLM / SGLang: extend the last assistant message instead of starting a new one; the chat
    # template here always starts a new turn.
    "continue_final_message": False,
}


class StreamOptions(StrictModel):
    include_usage: bool = False


class SamplingFields(StrictModel):
    """Sampling fields shared by both endpoints."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    # Ranges of the float fields: temperature's below (OpenAI's [0, 2]), the others by
    # SamplingParams. Neither is a pydantic constraint, whose message for JSON's NaN would name
    # one bound only ("should be less than or equal to 2").
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(default=None, ge=-1)
    seed: int | None = Field(default=None, ge=0)
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    skip_special_tokens: bool = True
    user: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    #: vLLM's extension: top-N log-probabilities of each prompt token given the ones before it
    #: (``SamplingParams.prompt_logprobs``), answered as ``prompt_logprobs`` (on the choice of a
    #: completion, at the top level of a chat response). Not with ``stream``.
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)
    # OpenAI fields that clients often send at their defaults: accepted at the value that changes
    # nothing, refused ("not supported") otherwise, so no request is silently served differently.
    #: OpenAI's ``{"type": "text" | "json_object" | "json_schema", "json_schema": {...}}``;
    #: mapped to a grammar by :mod:`~fastdeploy.entrypoints.openai.structured_request`.
    response_format: dict[str, Any] | None = None
    #: vLLM's structured outputs: ``{json | regex | choice | grammar | json_object: ...}``, and
    #: its older ``guided_*`` fields (one constraint per request in all).
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    #: OpenAI's tool calling (chat only; checked and planned by
    #: :mod:`~fastdeploy.entrypoints.openai.tool_request`, which refuses them on completions).
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    # Router extensions (module docstring): neutral values only, see NEUTRAL_ONLY.
    no_stop_trim: bool = False
    return_hidden_states: bool = False
    #: vLLM's PD field: ``{"do_remote_decode": true}`` on a prefill leg, a prefill node's answer on
    #: a decode leg. Only its type is checked here; the engine checks the content against its
    #: ``--splitwise-role``.
    kv_transfer_params: dict[str, Any] | None = None

    # check_fields=False: continue_final_message is a field of ChatCompletionRequest only.
    @field_validator(*NEUTRAL_ONLY, check_fields=False)
    @classmethod
    def _neutral_only(cls, v, info: ValidationInfo):
        allowed = NEUTRAL_ONLY[info.field_name]
        if v is not allowed:
            got, want = json.dumps(v), json.dumps(allowed)
            raise ValueError(f"{info.field_name}={got} is not supported; allowed: {want}")
        return v

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v: float | None) -> float | None:
        if v is not None and not (math.isfinite(v) and 0 <= v <= MAX_TEMPERATURE):
            raise ValueError(
                f"temperature={v!r} is invalid; allowed: a number in [0, {MAX_TEMPERATURE:g}]"
            )
        return v

    @field_validator("response_format")
    @classmethod
    def _format_type(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        kinds = ("text", "json_object", "json_schema")
        if v is not None and v.get("type") not in kinds:
            raise ValueError(
                f"response_format type {v.get('type')!r} is not supported; allowed: "
                + ", ".join(kinds)
            )
        return v


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


#: Content part types of OpenAI's chat API that this server knows but cannot serve (it runs
#: text-only models), ``{part type: what is refused}``; refused by :func:`check_chat_messages`.
UNSUPPORTED_PART_TYPES: dict[str, str] = {
    "image_url": "images are",
    "input_image": "images are",
    "input_audio": "audio is",
    "file": "files are",
    "refusal": "refusal parts are",
}

#: Content part types a chat message may hold.
ALLOWED_PART_TYPES: tuple[str, ...] = ("text",)

#: Roles whose messages must carry ``content`` (OpenAI's rule: only an assistant message may
#: leave it out, where it carries tool calls instead).
CONTENT_REQUIRED_ROLES: tuple[str, ...] = ("system", "developer", "user", "tool")


def check_chat_messages(messages: Any) -> None:
    """Refuse chat messages that OpenAI refuses, or that this server cannot serve, with a
    message naming the message index (and the part's), before pydantic's own type checks
    (whose error for a part that fits no member of the content union lists every member).

    Shapes it does not judge (not a list, a message that is not an object, an unknown role, a
    content of a wrong type) are left to pydantic, which names the field.

    Args:
        messages: the request's raw ``messages`` value (decoded JSON).

    Raises:
        ValueError: a ``system``, ``developer`` or ``user`` message without ``content`` (or
            with ``content: null``); a content part of a known type this server cannot serve
            (``image_url``, ``input_audio``, ...: the message says which kind of input is not
            supported); a part without a ``type`` or of an unknown type (the message names the
            allowed types).
    """
    if not isinstance(messages, list):
        return
    allowed = ", ".join(ALLOWED_PART_TYPES)
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            continue
        role = message.get("role")
        content = message.get("content")
        if role in CONTENT_REQUIRED_ROLES and content is None:
            raise ValueError(
                f"messages[{i}].content is required for a {role} message (only an assistant "
                "message may leave it out); allowed: a string or a list of text parts"
            )
        _check_tool_fields(i, message)
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if not isinstance(part, dict):
                continue
            where = f"messages[{i}].content[{j}]"
            kind = part.get("type")
            if kind in ALLOWED_PART_TYPES:
                continue
            if kind in UNSUPPORTED_PART_TYPES:
                raise ValueError(
                    f"{where} is a part of type {kind!r}: {UNSUPPORTED_PART_TYPES[kind]} not "
                    f"supported (this server runs text-only models); allowed part types: {allowed}"
                )
            if kind is None:
                raise ValueError(f"{where} has no 'type'; allowed part types: {allowed}")
            raise ValueError(
                f"{where} has the unknown part type {json.dumps(kind)}; allowed part types: "
                f"{allowed}"
            )


def _check_tool_fields(i: int, message: dict[str, Any]) -> None:
    """OpenAI's rules on the tool fields of message ``i``: ``tool_call_id`` (a non-empty
    string) on every ``tool`` message and only there; ``tool_calls`` only on an ``assistant``
    message, each ``{"id", "type": "function", "function": {"name", "arguments"}}`` with a
    JSON string as ``arguments``.

    Raises:
        ValueError: naming the field (``messages[i].tool_calls[j].function.arguments``) and
            what is allowed.
    """
    role = message.get("role")
    call_id = message.get("tool_call_id")
    if role == "tool" and not (isinstance(call_id, str) and call_id):
        raise ValueError(
            f"messages[{i}].tool_call_id is required for a tool message; allowed: the id of "
            "the assistant's tool call this message answers (a non-empty string)"
        )
    if role != "tool" and call_id is not None:
        raise ValueError(
            f"messages[{i}].tool_call_id is only allowed on a tool message, not on a {role} message"
        )
    calls = message.get("tool_calls")
    if calls is None:
        return
    if role != "assistant":
        raise ValueError(
            f"messages[{i}].tool_calls is only allowed on an assistant message, not on a "
            f"{role} message"
        )
    if not isinstance(calls, list):
        raise ValueError(f"messages[{i}].tool_calls is not a list; allowed: a list of tool calls")
    for j, call in enumerate(calls):
        where = f"messages[{i}].tool_calls[{j}]"
        shape = '{"id": ..., "type": "function", "function": {"name": ..., "arguments": "{...}"}}'
        if not isinstance(call, dict) or call.get("type", "function") != "function":
            raise ValueError(f"{where} is {json.dumps(call)[:200]}; allowed: {shape}")
        fn = call.get("function")
        if not isinstance(call.get("id"), str) or not call["id"]:
            raise ValueError(f"{where}.id is missing; allowed: a non-empty string")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"{where}.function.name is missing; allowed: {shape}")
        args = fn.get("arguments")
        if not isinstance(args, str):
            raise ValueError(
                f"{where}.function.arguments is {json.dumps(args)[:200]}; allowed: the "
                "arguments as a JSON string"
            )


class ToolCallFunction(StrictModel):
    name: str
    arguments: str


class ToolCallParam(StrictModel):
    """An assistant message's tool call (OpenAI's ``ChatCompletionMessageToolCall``)."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(StrictModel):
    """One chat message. ``content`` may be left out (or null) only by an ``assistant``
    message, as in OpenAI's API; :func:`check_chat_messages` enforces it at the request, and
    the rules on ``tool_calls`` (assistant only) and ``tool_call_id`` (tool only, required)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        """The message content as one string (text parts joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    """A chat completion request.

    ``separate_reasoning``, ``stream_reasoning`` (SGLang) and ``include_reasoning`` (vLLM) are
    accepted as ``true`` and ``false`` alike, and change nothing. In vLLM and SGLang each of them
    acts only when the server was started with ``--reasoning-parser``: it decides whether a
    reasoning model's thinking is moved out of ``content`` into ``reasoning_content``, streamed or
    held back, or dropped. Without a parser both servers ignore them and the thinking, if any, stays
    in ``content``. This server has no reasoning parser, so it is always in that case: either value
    asks for exactly what it does, for a reasoning model as for any other. Refusing one of the two
    would refuse bodies that ``vllm-router`` and ``sglang-router`` send by default (``true``) or
    that clients of a parser-less vLLM send (``false``), for no difference in the answer.
    """

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    include_reasoning: bool = True
    #: OpenAI's output modalities and audio output options: text only here, so ``modalities``
    #: is accepted as ``["text"]`` and ``audio`` only as null; anything else is refused saying
    #: that audio is not supported, rather than as an unknown field.
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None

    @field_validator("messages", mode="before")
    @classmethod
    def _openai_message_rules(cls, v: Any) -> Any:
        check_chat_messages(v)
        return v

    @field_validator("modalities")
    @classmethod
    def _text_modality(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and v != ["text"]:
            raise ValueError(
                f"modalities={json.dumps(v)} is not supported: audio is not supported (this "
                'server runs text-only models); allowed: ["text"] or null'
            )
        return v

    @field_validator("audio")
    @classmethod
    def _no_audio(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None:
            raise ValueError(
                "audio is not supported (audio output; this server runs text-only models); "
                "allowed: null"
            )
        return v


class CompletionRequest(SamplingFields):
    """A legacy completion request. ``echo`` (OpenAI's) puts the prompt before the completion
    in ``text``, and, with ``logprobs``, the prompt tokens first in ``logprobs`` (the first one's
    log-probability and top log-probabilities null); ``max_tokens: 0`` is allowed with it
    (scoring only). ``echo`` does not stream. Both rules are checked by the handler
    (``OpenAIServingCompletion.check_echo``), which names the field."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt_shape(cls, v):
        """A list prompt holds items of one kind: strings, token ids (integers, booleans
        excluded) or lists of token ids. A list that mixes them is refused naming the first
        item that differs, instead of pydantic's error for each branch of the union."""
        if not isinstance(v, list) or not v:
            return v

        def kind(item) -> str:
            if isinstance(item, str):
                return "a string"
            if isinstance(item, int) and not isinstance(item, bool):
                return "a token id (an integer)"
            if isinstance(item, list):
                return "a list of token ids"
            return f"{type(item).__name__} {item!r}"

        allowed = (
            "allowed: a string, a list of token ids (integers), or a list of strings or of "
            "token-id lists"
        )
        first = kind(v[0])
        if not first.startswith("a "):
            raise ValueError(f"prompt[0] is {first}; {allowed}")
        for i, item in enumerate(v):
            if kind(item) != first:
                raise ValueError(
                    f"prompt[{i}] is {kind(item)}, but prompt[0] is {first}; {allowed}"
                )
        return v

    @field_validator("suffix")
    @classmethod
    def _defaults_only(cls, v, info: ValidationInfo):
        """``suffix`` is not implemented: refused, naming the field, rather than ignored (a
        client would get a different answer than it asked for). ``best_of`` other than ``n`` is
        refused by the handler (:func:`~fastdeploy.entrypoints.openai.choices.check_n`), which
        knows ``n``."""
        default = {"suffix": (None,)}[info.field_name]
        if not any(v is d or (type(v) is int and v == d) for d in default):
            allowed = " or ".join(json.dumps(d) for d in default)
            raise ValueError(
                f"{info.field_name}={json.dumps(v)} is not supported; allowed: {allowed}"
            )
        return v


# ------------------------------------------------------------------------ tokenizer endpoints
# vLLM's bodies of ``POST /tokenize`` and ``POST /detokenize`` (vLLM v0.11.0,
# vllm/entrypoints/openai/protocol.py: TokenizeCompletionRequest, TokenizeChatRequest,
# TokenizeResponse, DetokenizeRequest, DetokenizeResponse); fields vLLM has for multimodal
# inputs and custom templates (``mm_processor_kwargs``, ``chat_template``) are unknown fields
# here, refused as such.
class TokenizeCompletionRequest(StrictModel):
    """``/tokenize`` of a text. ``add_special_tokens`` (default true, as vLLM): the tokenizer's
    own additions (a BOS token, for models that have one)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


#: Parameters of transformers' ``apply_chat_template`` itself, which ``chat_template_kwargs``
#: (template variables) may not set.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


class TokenizeChatRequest(StrictModel):
    """``/tokenize`` of a conversation, rendered by the chat template exactly as
    ``/v1/chat/completions`` renders it. ``add_special_tokens`` defaults to false (the template
    writes them). ``continue_final_message`` is accepted only as false, as on the chat endpoint.
    ``chat_template_kwargs`` are passed to the template (``enable_thinking`` and co)."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    #: vLLM's field: the tools the template lists, as on the chat endpoint.
    tools: list[Any] | None = None

    @field_validator("messages", mode="before")
    @classmethod
    def _openai_message_rules(cls, v: Any) -> Any:
        check_chat_messages(v)
        return v

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables_only(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        taken = sorted(set(v or ()) & RESERVED_TEMPLATE_KWARGS)
        if taken:
            raise ValueError(
                f"chat_template_kwargs may not set {', '.join(map(repr, taken))}; allowed: "
                "variables of the chat template (the request's own fields set the others)"
            )
        return v

    @field_validator("continue_final_message")
    @classmethod
    def _neutral(cls, v: bool) -> bool:
        if v is not False:
            raise ValueError("continue_final_message=true is not supported; allowed: false")
        return v


class TokenizeResponse(OpenAIModel):
    """``count`` = ``len(tokens)``; ``token_strs`` (the vocabulary entries) only when asked."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIModel):
    prompt: str
