"""The engine in a process of its own (the server's default), on CPU with a tiny random-weight
Llama in float32: it gives the same greedy tokens as the engine on a thread; a start-up error
reaches the server as the same exception; a killed engine process fails the in-flight requests
and the server sees it; a killed server process ends the engine process; nothing is left
running."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from tiny_models import tiny_llama

from fastdeploy.config.resolve import resolve_deployment
from fastdeploy.core.messages import (
    EngineStats,
    RequestFailed,
    StepOutputs,
    portable_error,
)
from fastdeploy.core.outputs import EngineOutput
from fastdeploy.core.sampling_params import SamplingParams
from fastdeploy.engine.admission import Admission
from fastdeploy.engine.args_utils import EngineArgs
from fastdeploy.engine.engine_core_proc import PipeEmitter
from fastdeploy.entrypoints.engine_client.async_engine import AsyncLLMEngine, EngineDeadError
from fastdeploy.entrypoints.engine_client.process_client import EngineCoreProcess

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 17, 99, 3, 250], list(range(40, 77)), [300] * 9]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_llama_proc")
    (d / "config.json").write_text(json.dumps(tiny_llama(num_hidden_layers=3)))
    return str(d)


def config_of(tiny_dir, **kw):
    args = dict(
        model=tiny_dir, load_format="dummy", skip_tokenizer_init=True, max_model_len=256,
        block_size=16, max_num_seqs=4, seed=0, device="cpu",
    )  # fmt: skip
    args.update(kw)
    return resolve_deployment(EngineArgs(**args))


async def collect(engine: AsyncLLMEngine, prompts, params=GREEDY) -> list[list[int]]:
    async def one(i, p):
        outs = [o async for o in engine.generate(f"r{i}", p, params)]
        return outs[-1].outputs[0].token_ids

    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


async def serve(core, prompts, params=GREEDY):
    engine = AsyncLLMEngine(core)
    engine.start()
    try:
        return await collect(engine, prompts, params)
    finally:
        await engine.shutdown()


@pytest.mark.slow
def test_process_gives_the_thread_engines_tokens_and_stops(tiny_dir):
    from fastdeploy.engine.engine import LLMEngine

    on_thread = asyncio.run(serve(LLMEngine(*config_of(tiny_dir)), PROMPTS))
    core = EngineCoreProcess(*config_of(tiny_dir), log_level="warning")
    pid = core.proc.pid
    assert core.max_model_len == 256 and core.vocab_size == 512
    assert core.describe()["config"]["model_config"]["max_model_len"] == 256
    in_process = asyncio.run(serve(core, PROMPTS))
    assert in_process == on_thread
    assert all(len(t) == 12 for t in in_process)
    assert not core.proc.is_alive() and core.proc.exitcode == 0
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


@pytest.mark.slow
def test_a_bad_request_is_refused_in_the_server_process(tiny_dir):
    core = EngineCoreProcess(*config_of(tiny_dir, max_model_len=32), log_level="warning")

    async def run():
        engine = AsyncLLMEngine(core)
        engine.start()
        try:
            with pytest.raises(ValueError, match="max_model_len"):
                engine.add_request("long", list(range(3, 40)), GREEDY)
            with pytest.raises(ValueError, match="0..511"):
                engine.add_request("vocab", [3, 600], GREEDY)
            # Nothing leaked: the next request is served.
            return await collect(engine, [[7, 8, 9]])
        finally:
            await engine.shutdown()

    assert len(asyncio.run(run())[0]) == 12


@pytest.mark.slow
def test_a_start_up_error_is_raised_in_the_server_and_the_process_exits(tiny_dir):
    # 2 blocks of 16 tokens: no request fits, which LLMEngine refuses while starting.
    config, plan = config_of(tiny_dir, num_gpu_blocks_override=1)
    started = time.monotonic()
    with pytest.raises(ValueError) as err:
        EngineCoreProcess(config, plan, log_level="error")
    assert "block" in str(err.value), str(err.value)
    assert time.monotonic() - started < 60


@pytest.mark.slow
def test_a_killed_engine_process_fails_the_requests_in_flight(tiny_dir):
    core = EngineCoreProcess(*config_of(tiny_dir), log_level="error")
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def run():
        engine = AsyncLLMEngine(core)
        engine.start()
        try:
            stream = engine.generate("r0", [5, 6, 7], long)
            first = await stream.__anext__()  # the request is running
            assert first.outputs[0].token_ids
            os.kill(core.proc.pid, signal.SIGKILL)
            started = time.monotonic()
            with pytest.raises(EngineDeadError, match="EngineProcessExitedError.*exited"):
                async for _ in stream:
                    pass
            assert time.monotonic() - started < 10
            assert not engine.is_running and engine.num_in_flight == 0
            # No engine holds requests or blocks any more: the gauges say so.
            assert engine.stats["num_running"] == 0 and engine.stats["num_total_blocks"] == 0
            assert "fastdeploy:num_requests_running 0.0" in engine.metrics.render().decode()
            with pytest.raises(EngineDeadError):
                engine.add_request("r1", [1, 2], GREEDY)
        finally:
            await engine.shutdown(timeout_s=5)

    asyncio.run(run())
    assert not core.proc.is_alive()


CHILD = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {tests!r})
    from test_engine_core_proc import config_of
    from fastdeploy.entrypoints.engine_client.process_client import EngineCoreProcess

    if __name__ == "__main__":
        core = EngineCoreProcess(*config_of({tiny_dir!r}), log_level="error")
        print(core.proc.pid, flush=True)
        sys.stdin.read()  # until killed
    """
)


@pytest.mark.slow
def test_a_killed_server_process_ends_the_engine_process(tiny_dir, tmp_path):
    script = tmp_path / "server.py"
    tests = os.path.dirname(os.path.abspath(__file__))
    script.write_text(CHILD.format(tests=tests, tiny_dir=tiny_dir))
    root = os.path.dirname(os.path.dirname(tests))  # this checkout, not an installed copy
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.path.dirname(tests), root])}
    server = subprocess.Popen(
        [sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
    )
    engine_pid = None
    try:
        engine_pid = int(server.stdout.readline())
        os.kill(engine_pid, 0)  # running
        server.kill()
        server.wait(10)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                os.kill(engine_pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            pytest.fail(f"engine process {engine_pid} still runs 15 s after its server died")
    finally:
        server.kill()
        server.wait(10)
        if engine_pid is not None:
            try:
                os.kill(engine_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class Unpicklable(Exception):
    def __init__(self, a, b):
        super().__init__(f"{a}/{b}")
        self.lock = __import__("threading").Lock()


def test_errors_that_do_not_pickle_travel_as_runtime_errors():
    err = portable_error(Unpicklable(1, 2))
    assert isinstance(err, RuntimeError) and "Unpicklable: 1/2" in str(err)
    fine = ValueError("x")
    assert portable_error(fine) is fine

    sent = []

    class Conn:
        def send(self, message):
            import pickle

            pickle.dumps(message)
            sent.append(message)

    emit = PipeEmitter(Conn(), None)
    out = EngineOutput("r", [1], None, True, "abort", error=Unpicklable(3, 4))
    emit(StepOutputs([out], {}, 0.0))
    emit(RequestFailed("r2", Unpicklable(5, 6)))
    assert isinstance(sent[0].outputs[0].error, RuntimeError)
    assert "5/6" in str(sent[1].error)


def test_admission_pickles_and_checks_as_the_engine_does():
    import pickle

    a = pickle.loads(pickle.dumps(Admission(64, 100, False, "lowered from 128 to 64")))
    with pytest.raises(ValueError, match="lowered from 128 to 64"):
        a.check(list(range(64)), GREEDY)
    with pytest.raises(ValueError, match="tokenizer"):
        a.check([1, 2], SamplingParams(stop=["x"]))
    assert a.check([1, 2], GREEDY) is None


def test_engine_output_pickles_every_field():
    """EngineOutput's compact pickling (constructor arguments) keeps every field: one added to
    the dataclass but not to ``__reduce__`` fails here."""
    import dataclasses
    import pickle

    values = {
        "request_id": "r", "new_token_ids": [1, 2], "new_logprobs": [{"token_id": 1}],
        "finished": True, "finish_reason": "stop", "num_prompt_tokens": 7,
        "num_cached_tokens": 3, "new_text": "ab", "stop_reason": "x",
        "kv_transfer_params": {"k": 1}, "error": None,
        "prompt_logprobs": [None, {"token_id": 2, "logprob": -1.0}],
    }  # fmt: skip
    assert set(values) == {f.name for f in dataclasses.fields(EngineOutput)}
    back = pickle.loads(pickle.dumps(EngineOutput(**values)))
    assert dataclasses.asdict(back) == values


def test_a_step_message_unpickles_as_the_same_plain_list_of_outputs():
    """The emitter's compact form of a step's outputs (EngineOutputList: rows of fields) gives
    back a plain list of equal outputs, every field kept, in order."""
    import pickle

    from fastdeploy.core.outputs import EngineOutputList

    outputs = [
        EngineOutput("a", [1], None, False, None, 5, 0, new_text=" x"),
        EngineOutput("b", [2, 3], [{"token_id": 2}], True, "stop", 7, 3, "ab", "x", {"k": 1}, None),
        EngineOutput("c", [], None, True, "abort", error=ValueError("gone")),
    ]
    back = pickle.loads(pickle.dumps(StepOutputs(EngineOutputList(outputs), {}, 0.0))).outputs
    assert type(back) is list and len(back) == 3
    assert back[:2] == outputs[:2]
    assert isinstance(back[2].error, ValueError) and back[2].finish_reason == "abort"


def test_the_command_pipe_closing_stops_the_loop_or_ends_a_starting_engine(monkeypatch):
    """End-of-file on the command pipe: once ready the loop gets StopLoop (it then releases the
    engine); while the engine still starts, the process exits at once."""
    import multiprocessing
    import queue
    import threading

    from fastdeploy.core.messages import AbortRequest, StopLoop
    from fastdeploy.engine import engine_core_proc

    exits = []

    def fake_exit(code):
        exits.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(engine_core_proc.os, "_exit", fake_exit)
    for started in (True, False):
        recv, send = multiprocessing.Pipe(duplex=False)
        send.send(AbortRequest("r"))
        send.close()
        commands = queue.SimpleQueue()
        ready = threading.Event()
        if started:
            ready.set()
        try:
            engine_core_proc.pump_commands(recv, commands, ready)
        except SystemExit:
            pass
        got = [commands.get_nowait() for _ in range(commands.qsize())]
        if started:
            assert got == [AbortRequest("r"), StopLoop()] and exits == []
        else:
            assert got == [AbortRequest("r")] and exits == [1]


def test_the_loop_sends_counters_once_per_step_and_after_commands_no_step_follows():
    """Adds that a step follows reach the server as that step's message only (its counters
    ride along); an add and abort when idle get a stats message of their own."""
    import queue

    from fastdeploy.core.messages import AbortRequest, AddRequest, StopLoop
    from fastdeploy.engine.engine_loop import EngineLoop

    commands: queue.SimpleQueue = queue.SimpleQueue()
    params = SamplingParams(max_tokens=1)

    class Stub:
        pending: list[str] = []
        steps = 0

        def add_request(self, request_id, prompt_token_ids, sampling_params):
            self.pending.append(request_id)

        def abort_request(self, request_id):
            self.pending.remove(request_id)

        def has_unfinished_requests(self):
            return bool(self.pending)

        def step(self):  # finishes every request; then "c" comes and goes while idle
            self.steps += 1
            done = [EngineOutput(r, [1], None, True, "length") for r in self.pending]
            self.pending = []
            commands.put(AddRequest("c", [1], params))
            commands.put(AbortRequest("c"))
            return done

        def get_stats(self):
            self.calls = getattr(self, "calls", 0) + 1
            if self.calls == 3:  # the idle stats message: then stop
                commands.put(StopLoop())
            return {"num_running": len(self.pending), "steps": self.steps}

    for cmd in (AddRequest("a", [1], params), AddRequest("b", [1], params), AbortRequest("b")):
        commands.put(cmd)
    sent: list = []
    EngineLoop(Stub(), commands, sent.append).run()
    assert [type(m) for m in sent] == [EngineStats, StepOutputs, EngineStats]
    assert [o.request_id for o in sent[1].outputs] == ["a"]
    assert sent[1].stats == {"num_running": 0, "steps": 1}
    assert sent[2].stats == {"num_running": 0, "steps": 1}


@pytest.mark.parametrize(
    "burst",
    [
        ("256", "1000", "20", "400"),
        # step messages of 8 x 20 KB, more than a pipe's 64 KiB: the engine's send of one
        # waits for the server, whose asyncio thread waits to send its commands; this one
        # deadlocked an engine loop that read its pipes itself at each drain (0dda645)
        ("256", "1000", "20000", "40"),
        # the same on uvloop, whose reader descriptors are non-blocking: a message over the
        # pipe's 64 KiB then arrives over several reads, and the second read of one used to
        # find the pipe empty (EAGAIN) and declare the engine dead (issue 43)
        ("256", "1000", "20000", "40", "uvloop"),
        # 1,000 outputs in every step (~100 KB a message), on uvloop
        ("1000", "8", "60", "30", "uvloop"),
    ],
    ids=["small-steps", "steps-over-a-pipe", "steps-over-a-pipe-uvloop", "1000-outputs-uvloop"],
)
@pytest.mark.slow
def test_a_burst_of_large_commands_during_large_step_messages_does_not_deadlock(burst):
    """The server writes commands on its asyncio thread while the engine process writes step
    messages; if the engine read its commands only between steps, both writes could wait on a
    full pipe for good (256 requests of 1,000 tokens while 8 streams run did, in review of
    9d3cadf). ``engine_proc_burst.py`` drives a real engine process with a stub engine; it runs
    in a session of its own so that a hang is killed with every process it started."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(here.parents[1]), str(here)]))
    proc = subprocess.Popen(
        [sys.executable, str(here / "engine_proc_burst.py"), *burst],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("the server and the engine process deadlocked on their pipes")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out
    assert f"done {burst[0]}" in out
