"""Server-sent events of a streaming response, encoded cheaply, and the one loop both endpoints
stream with.

Every streamed chunk of one response shares its ``id``, ``object``, ``created`` and ``model``
(OpenAI gives every chunk of a stream the same ``created``), so :class:`ChunkTemplate` renders the
JSON around the choice once per response and each chunk only encodes what changes: its text, finish
reason and logprobs. The bytes are what ``json.dumps(model.model_dump(mode="json"),
ensure_ascii=False)`` of the pydantic chunk models in
:mod:`~fastdeploy.entrypoints.openai.protocol` gives (the same fields, in the same order, with the
same separators; ``tests/entrypoints/test_sse.py`` checks it), at a fraction of the cost: at 64
concurrent streams the server encodes one chunk per stream per engine step on its one asyncio
thread, which shares the GIL with the engine loop.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from json.encoder import encode_basestring
from typing import Any

from fastdeploy.entrypoints.engine_client.async_engine import RequestStream
from fastdeploy.entrypoints.openai.errors import api_error_from
from fastdeploy.entrypoints.openai.protocol_responses import cached_prompt_tokens

#: The event that ends every stream.
DONE = "data: [DONE]\n\n"


def sse(payload: dict[str, Any] | str) -> str:
    """One server-sent event: ``data: <json>\\n\\n`` (or ``data: [DONE]\\n\\n``)."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


def to_json(value: Any) -> str:
    """``value`` as JSON the way the whole chunk is written (``ensure_ascii=False``)."""
    if value is None:
        return "null"
    if type(value) is str:
        return encode_basestring(value)
    return json.dumps(value, ensure_ascii=False)


class ChunkTemplate:
    """The JSON of one response's streamed chunks, rendered once around the choice.

    Args:
        request_id: the response id (``chatcmpl-...``, ``cmpl-...``).
        object_: ``chat.completion.chunk`` or ``text_completion``.
        created: Unix seconds, the same for every chunk of the response.
        model: the served model name.
    """

    def __init__(self, request_id: str, object_: str, created: int, model: str) -> None:
        self.top = (
            f'{{"id": {to_json(request_id)}, "object": {to_json(object_)}, '
            f'"created": {int(created)}, "model": {to_json(model)}, '
        )
        self.head = "data: " + self.top + '"choices": [{"index": '
        self.tail = '}], "usage": null}\n\n'

    def choice(self, fields: str, index: int = 0) -> str:
        """The event of a chunk with one choice, the choice ``index`` (OpenAI's: each chunk of an
        ``n > 1`` or several-prompt stream carries one choice); ``fields`` are the choice's fields
        after ``"index"`` as JSON (``'"text": "a", "logprobs": null, "finish_reason": null'``)."""
        return f"{self.head}{index}, {fields}{self.tail}"

    def usage(
        self, num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int = 0
    ) -> str:
        """The closing event with no choice and the usage (``stream_options.include_usage``):
        what :func:`~fastdeploy.entrypoints.openai.protocol_responses.usage_of` gives for the same
        counts (tokens), ``prompt_tokens_details.cached_tokens`` included."""
        total = num_prompt_tokens + num_completion_tokens
        cached = cached_prompt_tokens(num_cached_tokens, num_prompt_tokens)
        return (
            f'data: {self.top}"choices": [], "usage": {{"prompt_tokens": {num_prompt_tokens}, '
            f'"completion_tokens": {num_completion_tokens}, "total_tokens": {total}, '
            f'"prompt_tokens_details": {{"cached_tokens": {cached}}}}}}}\n\n'
        )


class StreamUsage:
    """What a stream's closing usage event counts, fed each output in turn by the renderer:
    completion tokens (each output's new token ids, summed over every choice) and cached prompt
    tokens (the first output's of each prompt, as
    :func:`~fastdeploy.entrypoints.openai.protocol_responses.cached_prompt_tokens` takes them).

    Args:
        num_prompt_tokens: the prompt length (tokens; summed over the prompts of a batch: each
            prompt counts once, however many choices it has).
        cached_from: request ids of the one choice per prompt whose cached tokens count (the
            first choice of each prompt); None: the one request of a one-choice stream.
    """

    def __init__(self, num_prompt_tokens: int, cached_from: set[str] | None = None) -> None:
        self.num_prompt_tokens = num_prompt_tokens
        self.num_tokens = 0
        self.num_cached: int | None = None
        self._cached_from = cached_from
        self._counted: set[str] = set()

    def count(self, ro: Any) -> None:
        """Add a ``RequestOutput``'s new tokens (and take its prompt's cached tokens from the
        first output of the choice that counts them)."""
        if self._cached_from is None:
            if self.num_cached is None:
                self.num_cached = ro.num_cached_tokens
        elif ro.request_id in self._cached_from and ro.request_id not in self._counted:
            self._counted.add(ro.request_id)
            self.num_cached = (self.num_cached or 0) + ro.num_cached_tokens
        self.num_tokens += len(ro.outputs[0].delta_token_ids)

    def closing(self, template: ChunkTemplate, include_usage: bool) -> str:
        """The usage event (:meth:`ChunkTemplate.usage`), or "" without ``include_usage``."""
        if not include_usage:
            return ""
        return template.usage(self.num_prompt_tokens, self.num_tokens, self.num_cached or 0)


async def stream_events(
    stream: RequestStream,
    render: Callable[[Any], str],
    closing: Callable[[], str],
    first: str | None = None,
) -> AsyncIterator[str]:
    """How every stream runs, for both endpoints: ``first`` (if any), then the events of each
    output (``render(output)``, ``""`` for an output with nothing to send), then ``closing()``
    (the usage event or nothing) and ``[DONE]``. An engine failure becomes an error event
    (the OpenAI error body of :func:`api_error_from`) and ``[DONE]``.

    One SSE event per new token, as the engine makes them: when the consumer fell behind by a few
    steps, the events of all the outputs waiting for it go out in one write (still one event
    each), so a slow step on the asyncio side costs one write per stream, not one per token. The
    request is aborted when the client leaves (the generator is closed or cancelled).
    """
    try:
        if first is not None:
            yield first
        while True:
            outputs = await stream.next_batch()
            if not outputs:
                break
            events = "".join([render(output) for output in outputs])
            if events:
                yield events
    except Exception as e:  # noqa: BLE001 - report to the client inside the stream
        yield sse(api_error_from(e).body())
        yield DONE
        return
    finally:
        stream.close()
    yield closing() + DONE
