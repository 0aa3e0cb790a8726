"""A burst of large commands to a real engine process (``run_engine_core`` with a stub engine)
while its step messages are large: the server's asyncio thread writes commands while the engine
writes step messages, so neither pipe may wait on its reader. Run as a script; prints ``done N``.

Used by ``test_engine_core_proc.py`` (a deadlock there would hang, so it runs this in a process
of its own with a time limit). Arguments: requests, prompt tokens, text bytes per output, and
optionally max tokens per request (default 400); the word ``uvloop`` anywhere runs the server's
side on uvloop, as ``fastdeploy serve`` does.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import sys
import threading
import time


class _Info:
    def to_dict(self) -> dict:
        return {}


class StubEngine:
    """Steps every 5 ms, one token per running request, ``TEXT`` bytes of text per output."""

    TEXT = 20

    def __init__(self, config, plan, freeze_heap: bool = True) -> None:
        self.pending: dict[str, int] = {}
        self.config = self.plan = _Info()

    def freeze_heap(self) -> None:  # the engine process calls it once the engine is ready
        pass

    def admission(self):
        return None

    def add_request(self, rid, ids, params) -> None:
        self.pending[rid] = params.max_tokens

    def abort_request(self, rid) -> None:
        self.pending.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.pending)

    def step(self) -> list:
        from fastdeploy.core.outputs import EngineOutput

        time.sleep(0.005)
        outs = []
        for rid in list(self.pending):
            self.pending[rid] -= 1
            done = self.pending[rid] == 0
            if done:
                del self.pending[rid]
            reason = "length" if done else None
            outs.append(EngineOutput(rid, [7], None, done, reason, 1, 0, "x" * self.TEXT))
        return outs

    def get_stats(self) -> dict:
        return {"num_running": len(self.pending)}

    def shutdown(self) -> None:
        pass


def engine_main(cmd_recv, out_send, text: int) -> None:
    import fastdeploy.engine.engine as engine_module
    from fastdeploy.engine import engine_core_proc

    StubEngine.TEXT = text
    engine_module.LLMEngine = StubEngine
    engine_core_proc.run_engine_core(None, None, "warning", cmd_recv, out_send)


class _Admission:
    def check(self, *args) -> None:
        return None


def start_core(text: int):
    from fastdeploy.core.messages import EngineReady
    from fastdeploy.entrypoints.engine_client.process_client import EngineCoreProcess

    ctx = multiprocessing.get_context("spawn")
    core = EngineCoreProcess.__new__(EngineCoreProcess)
    cmd_recv, core._cmd = ctx.Pipe(duplex=False)
    core._out, out_send = ctx.Pipe(duplex=False)
    core._send_lock = threading.Lock()
    core._stopping = core._reading = core._lost_reported = False
    core._loop = core._emit = core._watching = core.on_engine_lost = None
    core.extra_frontends = []
    core.proc = ctx.Process(target=engine_main, args=(cmd_recv, out_send, text))
    core.proc.start()
    cmd_recv.close()
    out_send.close()
    message = core._out.recv()
    assert isinstance(message, EngineReady), message
    core.tokenizer, core.max_model_len, core.max_model_len_note = None, 10**7, None
    core.vocab_size, core.admission, core._describe = 10**7, _Admission(), {}
    return core


async def main(n: int, prompt_len: int, text: int, max_tokens: int = 400) -> None:
    from fastdeploy.core.sampling_params import SamplingParams
    from fastdeploy.entrypoints.engine_client.async_engine import AsyncLLMEngine

    engine = AsyncLLMEngine(start_core(text))
    engine.start()
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    prompt = [1000 + j % 60000 for j in range(prompt_len)]

    async def one(i: int) -> int:
        await asyncio.sleep(0 if i < 8 else 0.1)  # 8 streams run, then the burst
        return sum([1 async for _ in engine.generate(f"r{i}", prompt, params)])

    try:
        got = await asyncio.gather(*(one(i) for i in range(n)))
        print("done", len(got), flush=True)
    finally:
        await engine.shutdown(5)


if __name__ == "__main__":
    numbers = [int(a) for a in sys.argv[1:] if a.isdigit()]
    if "uvloop" in sys.argv[1:]:  # the server's event loop: it makes a reader's fd non-blocking
        import uvloop

        uvloop.run(main(*numbers))
    else:
        asyncio.run(main(*numbers))
