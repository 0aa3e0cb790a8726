"""The asyncio side's per-step pieces, on their own: the output processor's outputs (new objects
each step, cumulative lists read as they were at that step), a request stream's batches, and the
step's token metrics recorded at once."""

from __future__ import annotations

import asyncio

import pytest

from fastdeploy.core.outputs import EngineOutput
from fastdeploy.core.sampling_params import SamplingParams
from fastdeploy.entrypoints.engine_client.output_processor import (
    CompletionOutput,
    OutputProcessor,
    RequestOutput,
)
from fastdeploy.entrypoints.engine_client.request_stream import RequestOutputs, RequestStream
from fastdeploy.metrics import ServerMetrics, StepTokens


def step(rid: str, tok: int, finished: bool = False, logprobs: bool = True) -> EngineOutput:
    entry = [{"token_id": tok, "logprob": -1.0, "top_logprobs": []}] if logprobs else None
    return EngineOutput(rid, [tok], entry, finished, "length" if finished else None,
                        new_text=chr(tok))  # fmt: skip


def test_each_step_gives_new_outputs_that_later_steps_leave_alone():
    proc = OutputProcessor()
    proc.add_request("a", "p", [1, 2], SamplingParams())
    outs = [proc.process([step("a", 97 + i, finished=i == 3)])[0] for i in range(4)]
    assert [o.outputs[0].token_ids for o in outs] == [[97], [97, 98], [97, 98, 99],
                                                      [97, 98, 99, 100]]  # fmt: skip
    assert [o.outputs[0].text for o in outs] == ["a", "ab", "abc", "abcd"]
    assert [o.outputs[0].delta_text for o in outs] == ["a", "b", "c", "d"]
    assert [len(o.outputs[0].logprobs) for o in outs] == [1, 2, 3, 4]
    assert [o.outputs[0].num_token_ids for o in outs] == [1, 2, 3, 4]
    assert [o.finished for o in outs] == [False, False, False, True]
    assert outs[-1].outputs[0].finish_reason == "length" and outs[-1].prompt_token_ids == [1, 2]
    assert len({id(o) for o in outs}) == 4 and len({id(o.outputs[0]) for o in outs}) == 4
    assert proc.process([step("a", 101)]) == []  # finished: no longer tracked


def test_text_is_joined_on_first_read_not_built_every_step():
    """Appending each step's text to one string copied the whole text every step (quadratic in
    the output's length); the pieces are kept instead and joined once, when ``text`` is read,
    as they were at that step."""
    proc = OutputProcessor()
    proc.add_request("a", None, [1], SamplingParams())
    outs = [proc.process([step("a", 97 + i)])[0].outputs[0] for i in range(3)]
    assert all(o._text is None for o in outs)  # nothing joined while streaming deltas
    assert [o.delta_text for o in outs] == ["a", "b", "c"]
    assert outs[1].text == "ab" and outs[1]._text == "ab"
    blank = EngineOutput("a", [5], None, True, "length", new_text="")
    last = proc.process([blank])[0].outputs[0]
    assert last.text == "abc" and outs[0].text == "a"
    last.text = "edited"
    assert last.text == "edited"


def test_a_prefix_read_while_the_request_runs_does_not_grow_afterwards():
    proc = OutputProcessor()
    proc.add_request("a", None, [1], SamplingParams())
    first = proc.process([step("a", 97)])[0].outputs[0]
    ids, logprobs = first.token_ids, first.logprobs  # read at once
    proc.process([step("a", 98)])
    assert ids == [97] and len(logprobs) == 1 and first.token_ids == [97]


def test_completion_output_is_built_and_compared_like_a_dataclass():
    out = CompletionOutput(0, "hi", [1, 2], None, "stop", "x")
    assert out.token_ids == [1, 2] and out.delta_token_ids == [] and out.logprobs is None
    assert out == CompletionOutput(0, "hi", [1, 2], None, "stop", "x")
    assert out != CompletionOutput(0, "hi", [1, 3], None, "stop", "x")
    out.token_ids = [5]
    out.logprobs = [{"token_id": 5}]
    assert out.num_token_ids == 1 and "token_ids=[5]" in repr(out)


def test_processor_without_logprobs_and_with_kv_params():
    proc = OutputProcessor()
    proc.add_request("a", None, [1], SamplingParams())
    eo = step("a", 97, finished=True, logprobs=False)
    eo.kv_transfer_params = {"remote_block_ids": [3]}
    (out,) = proc.process([eo])
    assert out.outputs[0].logprobs is None and out.kv_transfer_params == {"remote_block_ids": [3]}


class Aborts:
    def __init__(self) -> None:
        self.aborted: list[str] = []

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def ro(i: int, finished: bool = False) -> RequestOutput:
    return RequestOutput("r", None, [1], [CompletionOutput(0, delta_text=str(i))], finished)


def test_next_batch_takes_every_queued_output_and_ends_after_the_finished_one():
    async def body():
        outputs, engine = RequestOutputs(), Aborts()
        stream = RequestStream(engine, "r", outputs)
        waiter = asyncio.ensure_future(stream.next_batch())
        await asyncio.sleep(0)
        assert not waiter.done()  # waits for the first output
        outputs.put(ro(0))
        outputs.put(ro(1))
        first = await waiter
        outputs.put(ro(2))
        outputs.put(ro(3, finished=True))
        second = await stream.next_batch()
        assert await stream.next_batch() == []
        stream.close()
        return first, second, engine.aborted

    first, second, aborted = asyncio.run(body())
    assert [o.outputs[0].delta_text for o in first] == ["0", "1"]
    assert [o.outputs[0].delta_text for o in second] == ["2", "3"] and second[-1].finished
    assert aborted == []  # finished: closing aborts nothing


def test_an_error_comes_after_the_outputs_queued_before_it():
    async def body():
        outputs = RequestOutputs()
        stream = RequestStream(Aborts(), "r", outputs)
        outputs.put(ro(0))
        outputs.put(ValueError("boom"))
        got = await stream.next_batch()
        with pytest.raises(ValueError, match="boom"):
            await stream.next_batch()
        return got, await stream.next_batch()

    got, after = asyncio.run(body())
    assert [o.outputs[0].delta_text for o in got] == ["0"] and after == []


def test_anext_takes_one_output_at_a_time_and_cancel_loses_none():
    async def body():
        outputs, engine = RequestOutputs(), Aborts()
        stream = RequestStream(engine, "r", outputs)
        waiter = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)
        waiter.cancel()
        outputs.put(ro(0))
        outputs.put(ro(1, finished=True))
        got = [o.outputs[0].delta_text async for o in stream]
        return got, engine.aborted

    assert asyncio.run(body()) == (["0", "1"], [])


def test_an_unfinished_stream_aborts_on_close():
    engine = Aborts()
    stream = RequestStream(engine, "r", RequestOutputs())
    stream.close()
    stream.close()
    assert engine.aborted == ["r"]


def test_step_tokens_record_what_per_request_observations_record():
    one_by_one, at_once = ServerMetrics(), ServerMetrics()
    tokens = StepTokens()
    for num, interval in [(1, None), (1, 0.004), (1, 0.004), (3, 0.03), (2, 0.0), (1, 9.0)]:
        one_by_one.observe_tokens(num, interval)
        tokens.add(num, interval)
    at_once.observe_step_tokens(tokens)

    def samples(metrics: ServerMetrics) -> dict:
        families = metrics.registry.collect()
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for f in families
            if f.name.startswith(("fastdeploy:time_per_output", "fastdeploy:generation_tokens"))
            for s in f.samples
            if not s.name.endswith("_created")
        }

    got, want = samples(at_once), samples(one_by_one)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value), key
    assert got[("fastdeploy:generation_tokens_total", ())] == 9
    assert got[("fastdeploy:time_per_output_token_seconds_count", ())] == 8


def test_final_wakes_once_and_returns_the_finished_output():
    async def body():
        outputs = RequestOutputs()
        stream = RequestStream(Aborts(), "r", outputs)
        outputs.put(ro(0))  # queued before the consumer asked for the final output only
        final = asyncio.ensure_future(stream.final())
        await asyncio.sleep(0)
        for i in range(1, 5):
            outputs.put(ro(i))
            await asyncio.sleep(0)
            assert len(outputs) <= 1 and not final.done()  # only the newest is kept, no wake-up
        outputs.put(ro(5, finished=True))
        return await final

    assert asyncio.run(body()).outputs[0].delta_text == "5"


def test_final_raises_the_error():
    async def body():
        outputs = RequestOutputs()
        stream = RequestStream(Aborts(), "r", outputs)
        final = asyncio.ensure_future(stream.final())
        await asyncio.sleep(0)
        outputs.put(ro(0))
        outputs.put(RuntimeError("engine died"))
        with pytest.raises(RuntimeError, match="engine died"):
            await final

    asyncio.run(body())
