"""``POST /v1/chat/completions``: chat template, generation, JSON or server-sent events."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from fastdeploy.core.sampling_params import SamplingParams
from fastdeploy.entrypoints.openai.choices import (
    Choice,
    check_n,
    collect_finals,
    merged,
    open_choices,
)
from fastdeploy.entrypoints.openai.errors import APIError, api_error_from, bad_request
from fastdeploy.entrypoints.openai.logprobs import chat_logprobs, vllm_prompt_logprobs
from fastdeploy.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from fastdeploy.entrypoints.openai.protocol_responses import (
    ChatChoice,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
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
from fastdeploy.entrypoints.openai.tool_parser import HermesStreamParser, parse_tool_calls
from fastdeploy.entrypoints.openai.tool_request import (
    TemplateChoice,
    ToolPlan,
    ToolServingConfig,
    plan_tools,
    template_messages,
)

#: The first streamed chunk's choice: the role, no content yet.
ROLE_FIELDS = (
    '"delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null'
)


class OpenAIServingChat(OpenAIServing):
    """Handles chat completions for one served model. ``tool_config``: the server's tool flags
    (``--enable-auto-tool-choice``, ``--tool-call-parser``, ``--chat-template``)."""

    def __init__(
        self,
        engine: Any,
        served_model_name: str,
        stop_limits: Any = None,
        tool_config: ToolServingConfig | None = None,
    ) -> None:
        super().__init__(engine, served_model_name, stop_limits)
        self.tool_config = tool_config or ToolServingConfig()
        model_template = getattr(self.tokenizer, "chat_template", None)
        self.templates = TemplateChoice(
            model_template if isinstance(model_template, str) else None, self.tool_config
        )

    def render_prompt(
        self, req: ChatCompletionRequest, plan: ToolPlan | None = None
    ) -> tuple[str, list[int]]:
        """Apply the chat template to ``req.messages`` and the plan's tools; returns ``(prompt
        text, prompt token ids)`` (:meth:`render_messages`).

        Raises:
            APIError: 400 when the template rejects the conversation, or without a tokenizer.
        """
        tools = plan.tools if plan is not None else None
        return self.render_messages(req.messages, req.add_generation_prompt, tools=tools)

    def render_messages(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        add_special_tokens: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[Any] | None = None,
    ) -> tuple[str, list[int]]:
        """The one rendering of a conversation, for ``/v1/chat/completions`` and ``/tokenize``:
        the chat template (:class:`TemplateChoice`: ``--chat-template``, else the model's, or
        the shipped Hermes tool template for tools and tool history the model's cannot render)
        of the messages (:func:`template_messages`: ``developer`` as ``system``, tool calls and
        ids kept) and ``tools``, then the text's token ids. The template already writes the
        special tokens (``<|im_start|>`` ...), so by default the text is encoded without adding
        more. ``chat_template_kwargs`` go to the template as extra variables.

        Raises:
            APIError: 400 when the template rejects the conversation, or without a tokenizer.
        """
        self.require_tokenizer("chat completions (the chat template)", "messages")
        conversation = template_messages(messages)
        template = self.templates.pick(conversation, tools or [])
        extra: dict[str, Any] = dict(chat_template_kwargs or {})
        if template is not None:
            extra["chat_template"] = template
        if tools:
            extra["tools"] = tools
        try:
            text = self.tokenizer.apply_chat_template(
                conversation,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **extra,
            )
        except Exception as e:  # noqa: BLE001 - a template error is the client's conversation
            raise bad_request(f"the chat template rejected the messages: {e}", "messages") from None
        return text, self.encode(text, "messages", add_special_tokens=add_special_tokens)

    async def create(self, req: ChatCompletionRequest, raw_request: HTTPRequest) -> Response:
        """Run one chat completion.

        Raises:
            APIError: 400 bad field, 404 unknown model, 429 queue full, 503 engine stopped.
        """
        self.check_model(req.model)
        if req.stream_options is not None and not req.stream:
            raise bad_request(
                "stream_options is only allowed when stream is true", "stream_options"
            )
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        max_tokens_param = (
            "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        )
        max_tokens = getattr(req, max_tokens_param)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        if req.tools:  # the grammar is built on the tokenizing thread: the first import of
            # xgrammar takes seconds, a tool set's first grammar about a millisecond
            plan = await self.off_loop(plan_tools, req, self.tool_config)
        else:
            plan = plan_tools(req, self.tool_config)
        params = sampling_params_from(
            req, max_tokens, logprobs, stop_limits=self.stop_limits, structured_outputs=plan.grammar
        )
        check_n(
            req.n, 1, req.kv_transfer_params, None, getattr(self.engine, "max_concurrency", None)
        )
        prompt, prompt_ids = await self.off_loop(self.render_prompt, req, plan)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"

        def admit(rid: str, i: int, choice_params: SamplingParams) -> Any:
            return self.admit(
                rid, prompt_ids, choice_params, prompt, "messages", req, max_tokens_param
            )

        try:
            choices = await open_choices(admit, request_id, 1, req.n, params, raw_request)
        except APIError:
            raise
        except Exception as e:  # noqa: BLE001 - engine-side failure of the first choice
            raise api_error_from(e) from None
        if choices is None:  # the client went away; nobody reads this
            return Response(status_code=499)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(
                self._stream(
                    choices, request_id, len(prompt_ids), include_usage, req.logprobs, plan
                ),
                media_type="text/event-stream",
            )
        try:
            finals = await collect_finals(choices, raw_request)
        except Exception as e:  # noqa: BLE001 - engine-side failure of this request
            raise api_error_from(e) from None
        if finals is None:  # the client went away; nobody reads this
            return Response(status_code=499)
        body_choices = []
        for choice, final in zip(choices, finals):
            comp = final.outputs[0]
            message, reason = ChatResponseMessage(content=comp.text), comp.finish_reason
            if plan.parses:  # each choice parses on its own
                content, calls = parse_tool_calls(comp.text, plan.names, plan.parallel)
                if calls:
                    message = ChatResponseMessage(
                        content=content, tool_calls=[c.to_openai() for c in calls]
                    )
                    reason = "tool_calls"
            body_choices.append(
                ChatChoice(
                    index=choice.index,
                    message=message,
                    logprobs=ChatLogprobs(content=chat_logprobs(self.token_bytes, comp.logprobs))
                    if req.logprobs
                    else None,
                    finish_reason=reason,
                )
            )
        first = finals[0]  # the choice that prefilled the prompt
        num_output_tokens = sum(len(f.outputs[0].token_ids) for f in finals)
        body = ChatCompletionResponse(
            id=request_id,
            model=self.served_model_name,
            choices=body_choices,
            usage=usage_of(len(prompt_ids), num_output_tokens, first.num_cached_tokens),
            prompt_logprobs=vllm_prompt_logprobs(self.token_bytes, first.prompt_logprobs),
        )
        return JSONResponse(with_kv_transfer_params(dump(body), first))

    def _stream(
        self,
        choices: list[Choice],
        request_id: str,
        num_prompt_tokens: int,
        include_usage: bool,
        with_logprobs: bool,
        plan: ToolPlan | None = None,
    ) -> AsyncIterator[str]:
        """Server-sent events: a role chunk per choice, one chunk per step and choice with new
        text, each choice's finish reason, an optional usage chunk, then ``[DONE]``. An engine
        failure becomes an error event. Each chunk is a ``ChatCompletionChunk`` with one choice
        and its ``index``, encoded through a :class:`ChunkTemplate`. The usage counts the prompt
        once and sums every choice's tokens; its ``cached_tokens`` are the first choice's first
        output's (:func:`~fastdeploy.entrypoints.openai.protocol_responses.cached_prompt_tokens`).

        With a ``plan`` that parses tool calls, each choice's text goes through a
        :class:`HermesStreamParser` of its own: deltas carry ``content`` and/or ``tool_calls``,
        and a choice that made calls finishes with ``tool_calls``."""
        template = ChunkTemplate(
            request_id, "chat.completion.chunk", int(time.time()), self.served_model_name
        )
        stream, index_of, firsts = merged(choices)
        usage = StreamUsage(num_prompt_tokens, firsts)
        parsers: dict[str, HermesStreamParser] = {}
        if plan is not None and plan.parses:
            parsers = {c.request_id: HermesStreamParser(plan.names, plan.parallel) for c in choices}

        def render(ro: Any) -> str:
            usage.count(ro)
            comp = ro.outputs[0]
            logprobs = None
            if with_logprobs:
                logprobs = chat_logprobs(self.token_bytes, comp.delta_logprobs)
            reason = comp.finish_reason if ro.finished else None
            parser = parsers.get(ro.request_id)
            if parser is not None:
                return parsed_events(
                    template,
                    index_of[ro.request_id],
                    parser,
                    comp.delta_text,
                    ro.finished,
                    reason,
                    logprobs,
                )
            delta = f'{{"content": {to_json(comp.delta_text)}}}'
            has_delta = bool(comp.delta_text)
            if not (has_delta or ro.finished or logprobs):
                return ""
            lp = "null" if logprobs is None else f'{{"content": {to_json(logprobs)}}}'
            return template.choice(
                f'"delta": {delta}, "logprobs": {lp}, "finish_reason": {to_json(reason)}',
                index_of[ro.request_id],
            )

        def closing() -> str:
            return usage.closing(template, include_usage)

        roles = "".join(template.choice(ROLE_FIELDS, c.index) for c in choices)
        return stream_events(stream, render, closing, first=roles)


def parsed_events(
    template: ChunkTemplate,
    index: int,
    parser: HermesStreamParser,
    delta_text: str,
    finished: bool,
    reason: str | None,
    logprobs: list[Any] | None,
) -> str:
    """The chunks of one step of a choice whose text goes through a tool call ``parser``:
    ``content`` and/or ``tool_calls`` deltas (:meth:`StreamDelta.parts`: one chunk per part),
    the logprobs on the first chunk, the finish ``reason`` of a ``finished`` choice
    (``tool_calls`` when it made calls, unless ``length`` cut it) on the last; "" when there is
    nothing to send."""
    step = parser.feed(delta_text)
    if finished:
        tail = parser.finish()
        step.content += tail.content
        step.tool_calls += tail.tool_calls
        if parser.num_calls and reason != "length":  # a call cut off stays visible as such
            reason = "tool_calls"
    if not (step or finished or logprobs):
        return ""
    parts = step.parts()
    events = []
    for i, (content, calls) in enumerate(parts):
        fields = []
        if content or not calls:
            fields.append(f'"content": {to_json(content)}')
        if calls:
            fields.append(f'"tool_calls": {to_json(calls)}')
        lp = "null" if logprobs is None or i else f'{{"content": {to_json(logprobs)}}}'
        last = i == len(parts) - 1
        events.append(
            template.choice(
                f'"delta": {{{", ".join(fields)}}}, "logprobs": {lp}, '
                f'"finish_reason": {to_json(reason if last else None)}',
                index,
            )
        )
    return "".join(events)
