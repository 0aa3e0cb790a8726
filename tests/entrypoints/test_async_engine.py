"""AsyncLLMEngine on its own (fake engine): admission checks, abort on cancel, shutdown."""

from __future__ import annotations

import asyncio
import threading

import pytest
from fake_llm_engine import FakeEngine, expected_text

from fastdeploy.core.sampling_params import SamplingParams
from fastdeploy.entrypoints.engine_client.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    QueueFullError,
)


def run(coro_fn, engine: FakeEngine, **kw):
    """Run ``coro_fn(async_engine)`` with a started engine, shutting it down afterwards."""

    async def main():
        async_engine = AsyncLLMEngine(engine, **kw)
        async_engine.start()
        try:
            return await asyncio.wait_for(coro_fn(async_engine), timeout=20)
        finally:
            await async_engine.shutdown()

    return asyncio.run(main())


def test_generate_streams_one_output_per_step():
    async def body(ae):
        outs = [o async for o in ae.generate("r1", [65, 66], SamplingParams(max_tokens=5))]
        return outs

    engine = FakeEngine()
    outs = run(body, engine)
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 2, 3, 4, 5]
    assert outs[-1].finished and outs[-1].outputs[0].text == expected_text([65, 66], 5)
    assert engine.is_shut_down


def test_cancelled_consumer_aborts_request():
    engine = FakeEngine(step_delay_s=0.01)

    async def body(ae):
        async def consume():
            async for _ in ae.generate("r1", [65], SamplingParams(max_tokens=1000)):
                pass

        task = asyncio.create_task(consume())
        while not engine.steps:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        while "r1" not in engine.aborted:
            await asyncio.sleep(0.01)
        return ae.num_in_flight

    assert run(body, engine) == 0
    assert not engine.requests


def test_admission_checks_are_synchronous():
    async def body(ae):
        params = SamplingParams(max_tokens=100)
        with pytest.raises(ValueError, match="prompt has 32 tokens, but max_model_len is 32"):
            ae.add_request("a", [65] * 32, params)
        with pytest.raises(ValueError, match="empty"):
            ae.add_request("a", [], params)
        with pytest.raises(ValueError, match="vocabulary"):
            ae.add_request("a", [65, 300], params)
        first = ae.add_request("a", [65], params)
        with pytest.raises(ValueError, match="already in flight"):
            ae.add_request("a", [65], params)
        with pytest.raises(QueueFullError, match="1 concurrent"):
            ae.add_request("b", [65], params)
        first.close()
        return ae.num_in_flight

    assert run(body, FakeEngine(max_model_len=32, step_delay_s=0.01), max_concurrency=1) == 0


def test_admission_is_the_engines_check_request_on_the_callers_thread():
    """One length rule: the async front end asks engine.check_request (max_model_len tokens
    refused, one fewer accepted) and runs it synchronously, off the engine thread."""

    class CountingEngine(FakeEngine):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.checked: list[tuple[int, int]] = []  # (prompt length, thread id)

        def check_request(self, prompt_token_ids, sampling_params=None):
            self.checked.append((len(prompt_token_ids), threading.get_ident()))
            super().check_request(prompt_token_ids, sampling_params)

    engine = CountingEngine(max_model_len=32)

    async def body(ae):
        params = SamplingParams(max_tokens=1)
        with pytest.raises(ValueError, match="prompt has 32 tokens, but max_model_len is 32"):
            ae.add_request("long", [65] * 32, params)
        return [o async for o in ae.generate("fits", [65] * 31, params)][-1].finished

    assert run(body, engine) is True
    assert engine.checked == [(32, threading.get_ident()), (31, threading.get_ident())]
    assert threading.get_ident() not in engine.thread_ids  # add_request/step: engine thread


def test_shutdown_fails_in_flight_requests():
    engine = FakeEngine(step_delay_s=0.01)

    async def main():
        ae = AsyncLLMEngine(engine)
        ae.start()
        stream = ae.add_request("r", [65], SamplingParams(max_tokens=10_000))
        await stream.__anext__()
        await ae.shutdown()
        with pytest.raises(EngineDeadError, match="shutting down"):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            ae.add_request("s", [65], SamplingParams())
        return ae.is_running

    assert asyncio.run(asyncio.wait_for(main(), timeout=20)) is False
    assert engine.is_shut_down


def test_output_processing_failure_fails_only_that_request():
    class BrokenProcessor:
        def __init__(self, real):
            self.real = real

        def add_request(self, *args):
            self.real.add_request(*args)

        def abort_request(self, request_id):
            self.real.abort_request(request_id)

        def process(self, outputs):
            if any(o.request_id == "bad" for o in outputs):
                raise UnicodeDecodeError("utf-8", b"", 0, 1, "simulated")
            return self.real.process(outputs)

    from fastdeploy.entrypoints.engine_client.output_processor import OutputProcessor

    engine = FakeEngine()

    async def body(ae):
        with pytest.raises(RuntimeError, match="output processing failed"):
            async for _ in ae.generate("bad", [65], SamplingParams(max_tokens=3)):
                pass
        good = [o async for o in ae.generate("good", [66], SamplingParams(max_tokens=3))]
        return good[-1].outputs[0].text

    processor = BrokenProcessor(OutputProcessor())
    assert run(body, engine, output_processor=processor) == expected_text([66], 3)


def test_slow_consumer_loses_no_delta():
    async def body(ae):
        deltas, last = [], None
        async for out in ae.generate("r", [70, 71], SamplingParams(max_tokens=30)):
            deltas.append(out.outputs[0].delta_text)
            last = out
            await asyncio.sleep(0.01)  # slower than the engine: several steps queue up
        return "".join(deltas), last.outputs[0].text

    streamed, final = run(body, FakeEngine())
    assert streamed == final == expected_text([70, 71], 30)
