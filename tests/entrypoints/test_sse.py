"""Streamed chunks are encoded through templates (fastdeploy.entrypoints.openai.sse): their bytes
must equal ``json.dumps(pydantic model.model_dump(mode="json"), ensure_ascii=False)`` of the
protocol's chunk models, for every kind of chunk both endpoints send."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from fake_llm_engine import FakeTokenizer

from fastdeploy.core.sampling_params import SamplingParams
from fastdeploy.entrypoints.engine_client.output_processor import CompletionOutput, RequestOutput
from fastdeploy.entrypoints.openai.choices import Choice
from fastdeploy.entrypoints.openai.logprobs import chat_logprobs, completion_logprobs
from fastdeploy.entrypoints.openai.protocol_responses import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatLogprobs,
    CompletionChoice,
    CompletionResponse,
    DeltaMessage,
    dump,
    usage_of,
)
from fastdeploy.entrypoints.openai.serving_chat import OpenAIServingChat
from fastdeploy.entrypoints.openai.serving_completion import OpenAIServingCompletion
from fastdeploy.entrypoints.openai.sse import ChunkTemplate, to_json

NOW = 1_700_000_000.75
TEXTS = ["plain", 'quo"te \\ back', "ctl\n\t\x01", "é中文🙂", "\u2028\u2029", "", "</script>"]


class Engine:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer


class Stream:
    """Hands out prepared batches of outputs, as ``RequestStream.next_batch`` does."""

    def __init__(self, batches: list[list], error: BaseException | None = None) -> None:
        self.batches = list(batches)
        self.error = error
        self.closed = False
        self.request_id = "r"

    async def next_batch(self) -> list:
        if self.batches:
            return self.batches.pop(0)
        if self.error is not None:
            error, self.error = self.error, None
            raise error
        return []

    def close(self) -> None:
        self.closed = True


def outputs(texts: list[str], logprobs: bool, finish: str = "length") -> list[RequestOutput]:
    """One output per text, token ids = first character's code point, the last one finished."""
    result, ids = [], []
    for i, text in enumerate(texts):
        tok = ord(text[0]) % 256 if text else 0
        ids = ids + [tok]
        entry = [
            {"token_id": tok, "logprob": -0.5 * i, "top_logprobs": [(tok, -0.5 * i), (97, -2)]}
        ]
        last = i == len(texts) - 1
        comp = CompletionOutput(
            0, "", ids, None, finish if last else None, None, text, [tok],
            entry if logprobs else None,
        )  # fmt: skip
        result.append(RequestOutput("r", None, [1], [comp], finished=last))
    return result


def one(stream: Stream) -> list[Choice]:
    """The one choice of a one-choice request, streaming ``stream``."""
    return [Choice(0, 0, stream)]


def collect(agen) -> list[str]:
    async def run():
        return [event async for event in agen]

    return asyncio.run(run())


def sse(model) -> str:
    return f"data: {json.dumps(dump(model), ensure_ascii=False)}\n\n"


@pytest.fixture(autouse=True)
def fixed_clock(monkeypatch):
    monkeypatch.setattr(time, "time", lambda: NOW)


@pytest.mark.parametrize("tokenizer", [FakeTokenizer(), None], ids=["tokenizer", "token-ids"])
@pytest.mark.parametrize("logprobs", [None, 2])
def test_completion_chunks_equal_the_models(tokenizer, logprobs):
    handler = OpenAIServingCompletion(Engine(tokenizer), "m-\u00e9")
    params = SamplingParams(logprobs=logprobs)
    outs = outputs(TEXTS, logprobs is not None)
    stream = Stream([outs[:1], outs[1:4], outs[4:]])
    got = "".join(collect(handler._stream(one(stream), "cmpl-1", 7, True, params)))
    offsets = handler.text_offsets(params)
    want = []
    for ro in outs:
        comp = ro.outputs[0]
        lp = None
        if logprobs is not None:
            lp = completion_logprobs(handler.token_bytes, comp.delta_logprobs, offsets)
        ids = {"token_ids": comp.delta_token_ids} if tokenizer is None else {}
        if not (comp.delta_text or ids or (lp and lp["tokens"]) or ro.finished):
            continue
        choice = CompletionChoice(
            text=comp.delta_text, logprobs=lp,
            finish_reason=comp.finish_reason if ro.finished else None, **ids,
        )  # fmt: skip
        want.append(sse(CompletionResponse(id="cmpl-1", model="m-\u00e9", choices=[choice])))
    usage = usage_of(7, len(outs[-1].outputs[0].token_ids))
    want.append(sse(CompletionResponse(id="cmpl-1", model="m-\u00e9", choices=[], usage=usage)))
    assert got == "".join(want) + "data: [DONE]\n\n"
    assert stream.closed


@pytest.mark.parametrize("with_logprobs", [False, True])
def test_chat_chunks_equal_the_models(with_logprobs):
    handler = OpenAIServingChat(Engine(FakeTokenizer()), "m")
    outs = outputs(TEXTS, with_logprobs, finish="stop")
    stream = Stream([outs[:2], outs[2:]])
    events = collect(handler._stream(one(stream), "chatcmpl-1", 5, True, with_logprobs))
    want = [sse(ChatCompletionChunk(id="chatcmpl-1", model="m", choices=[
        ChatChunkChoice(delta=DeltaMessage(role="assistant", content=""))])
    )]  # fmt: skip
    for ro in outs:
        comp = ro.outputs[0]
        lp = chat_logprobs(handler.token_bytes, comp.delta_logprobs) if with_logprobs else None
        if not (comp.delta_text or ro.finished or lp):
            continue
        choice = ChatChunkChoice(
            delta=DeltaMessage(content=comp.delta_text),
            finish_reason=comp.finish_reason if ro.finished else None,
            logprobs=ChatLogprobs(content=lp) if lp is not None else None,
        )
        want.append(sse(ChatCompletionChunk(id="chatcmpl-1", model="m", choices=[choice])))
    usage = usage_of(5, len(TEXTS))
    want.append(sse(ChatCompletionChunk(id="chatcmpl-1", model="m", choices=[], usage=usage)))
    assert events[0] == want[0]  # the role chunk goes out on its own, before any token
    assert "".join(events) == "".join(want) + "data: [DONE]\n\n"


def test_chat_logprobs_of_an_output_without_entries_are_an_empty_list():
    handler = OpenAIServingChat(Engine(FakeTokenizer()), "m")
    comp = CompletionOutput(0, "", [5], None, "length", None, "", [5], None)
    events = collect(handler._stream(one(Stream([[RequestOutput("r", None, [1], [comp], True)]])),
                                     "c", 1, False, True))  # fmt: skip
    choice = ChatChunkChoice(delta=DeltaMessage(content=""), finish_reason="length",
                             logprobs=ChatLogprobs(content=[]))  # fmt: skip
    assert events[1] == sse(ChatCompletionChunk(id="c", model="m", choices=[choice]))


def test_error_becomes_an_error_event_then_done():
    handler = OpenAIServingChat(Engine(FakeTokenizer()), "m")
    outs = outputs(["a", "b"], False)
    stream = Stream([outs[:1]], error=ValueError("bad thing"))
    events = collect(handler._stream(one(stream), "c", 1, True, False))
    error = json.loads(events[-2][len("data: ") :])["error"]
    assert error["message"] == "bad thing" and error["code"] is None
    assert events[-1] == "data: [DONE]\n\n" and stream.closed
    assert not any('"usage": {' in e for e in events)  # no usage after a failure


@pytest.mark.parametrize("value", [None, "x\u00e9\U0001f642\"\n", 3, -0.25, float("-inf"),
                                   [1, 2], {"a": [0.5, None]}])  # fmt: skip
def test_to_json_is_json_dumps(value):
    assert to_json(value) == json.dumps(value, ensure_ascii=False)


def test_template_usage_and_choice():
    template = ChunkTemplate("id-1", "text_completion", NOW, "m")
    fields = '"text": "a", "logprobs": null, "finish_reason": null'
    choice = CompletionChoice(text="a")
    assert template.choice(fields) == sse(
        CompletionResponse(id="id-1", model="m", choices=[choice])
    )
    usage = CompletionResponse(id="id-1", model="m", choices=[], usage=usage_of(3, 4))
    assert template.usage(3, 4) == sse(usage)
    assert '"prompt_tokens_details": {"cached_tokens": 0}' in template.usage(3, 4)
    for prompt, cached in ((40, 32), (40, 48)):  # 48: capped to the prompt's 40
        usage = CompletionResponse(id="id-1", model="m", choices=[],
                                   usage=usage_of(prompt, 4, cached))  # fmt: skip
        assert template.usage(prompt, 4, cached) == sse(usage)
        details = json.loads(template.usage(prompt, 4, cached)[6:])["usage"]
        assert details["prompt_tokens_details"] == {"cached_tokens": min(cached, prompt)}


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_streamed_usage_has_the_first_outputs_cached_tokens(endpoint):
    """The first output's count is the admission that made the first token (what TTFT saw); a
    later one may come from a re-admission after a preemption, whose lookup also covers the
    generated tokens (48 here, for a 40-token prompt)."""
    outs = outputs(["a", "b", "c"], False)
    for ro, n in zip(outs, (32, 48, 48)):
        ro.num_cached_tokens = n
    if endpoint == "chat":
        handler = OpenAIServingChat(Engine(FakeTokenizer()), "m")
        events = collect(handler._stream(one(Stream([outs[:2], outs[2:]])), "c", 40, True, False))
    else:
        handler = OpenAIServingCompletion(Engine(FakeTokenizer()), "m")
        params = SamplingParams()
        events = collect(handler._stream(one(Stream([outs[:2], outs[2:]])), "c", 40, True, params))
    usage = json.loads(events[-1].split("\n\n")[0][len("data: ") :])["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 32}
    assert usage["prompt_tokens"] == 40 and usage["completion_tokens"] == 3
