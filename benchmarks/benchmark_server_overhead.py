"""Server overhead: how fast the serving path (asyncio side, SSE, HTTP) keeps up with the engine.

The model is replaced by a synthetic engine whose step takes ``--step-ms`` of GIL-free sleep (the
time a GPU step would wait on the device) and then does the engine's real per-token host work:
the :class:`~fastdeploy.core.stop_checker.StopChecker` with the real tokenizer's incremental
detokenizer. Everything after ``engine.step()`` is the real server: ``AsyncLLMEngine``, the
OpenAI handlers, FastAPI/uvicorn. One command (64 streams, 256 in, 128 out, seed 0, the default
GGUF's tokenizer, a warm-up of 8 requests first)::

    python benchmarks/benchmark_server_overhead.py
    python benchmarks/benchmark_server_overhead.py --no-http          # handlers only, no HTTP
    python benchmarks/benchmark_server_overhead.py --profile out.prof # cProfile, asyncio thread

It prints one table:

* offline: the synthetic engine stepped alone (no server), output tok/s;
* served: closed-loop streaming clients of ``/v1/completions`` in a separate process (a minimal
  raw HTTP/1.1 client: ``httpx``, as in ``benchmark_serving.py``, spends about 70 us of CPU per
  streamed chunk, which would make the client the bottleneck), or with ``--no-http`` in-process
  consumers of the handler's SSE strings; output tok/s, served/offline, TPOT and ITL p50;
* CPU per token of the server's asyncio thread, of the engine thread (per-thread CPU clocks over
  the timed run) and of the client, and the asyncio thread's CPU per step of all streams: the
  number that must stay well under the step time, since both threads share one GIL.

The synthetic engine runs on a thread of the server process (``ThreadCore``, the server's
``--disable-frontend-multiprocessing``), so the asyncio thread's numbers here are the serving
path's own cost; the server's default puts the engine in a process of its own.

On a host with few cores the client competes with the server for them, so served/offline and
TPOT there understate the server; the per-token CPU numbers do not depend on it.

Measured on a 2-CPU x86 VM (AMD EPYC, shared), medians of 3 interleaved runs, defaults: before
the SSE templates and the copy-free hand-off, the asyncio thread spent 46 us per token over HTTP
(3.0 ms per 64-stream step; served/offline 0.30, TPOT p50 4.1 ms) and 19 us without HTTP; after,
17.5 us over HTTP (1.1 ms per step; 0.62, 1.6 ms) and 5.8 us without. uvicorn + h11 alone, a
bare ASGI app streaming constant chunks, costs about 10 us per chunk on that host (FastAPI's
``StreamingResponse`` about 11.5): most of what is left is the HTTP stack and the kernel.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import platform
import random
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing it
sys.path.insert(0, str(ROOT / "benchmarks"))

from sse_client import p50_ms  # noqa: E402

from fastdeploy.core.outputs import EngineOutput  # noqa: E402
from fastdeploy.core.request import Request, check_prompt, check_sampling  # noqa: E402
from fastdeploy.core.stop_checker import StopChecker  # noqa: E402

TEXT = (
    "The quick brown fox jumps over the lazy dog. Serving engines stream tokens to many clients "
    "at once; each token becomes a server-sent event with a small JSON body. Paris is the capital "
    "of France, and its museums hold paintings, sculptures and manuscripts from many centuries. "
)


class SyntheticEngine:
    """An ``LLMEngine`` stand-in: each step sleeps ``step_s`` (GIL released, as while a GPU step
    runs), then emits one token per running request, stop-checked and detokenized by the real
    :class:`StopChecker` as the engine does. Tokens cycle through a tokenized English text."""

    def __init__(
        self, tokenizer: Any, step_s: float, max_model_len: int = 4096, host_s: float = 0.0
    ) -> None:
        self.tokenizer = tokenizer
        self.host_s = host_s
        self.max_model_len = max_model_len
        self.vocab_size = len(tokenizer)
        self.step_s = step_s
        self.stop_checker = StopChecker(max_model_len, tokenizer)
        self.text_ids = tokenizer.encode(TEXT * 4, add_special_tokens=False)
        self.eos = frozenset({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else ())
        self.requests: dict[str, Request] = {}
        self.steps = 0

    def check_request(self, prompt_token_ids, sampling_params=None, kv_transfer_params=None):
        check_prompt(prompt_token_ids, self.max_model_len, self.vocab_size)
        if sampling_params is not None:
            check_sampling(sampling_params, self.vocab_size, True)

    def add_request(self, request_id, prompt_token_ids, sampling_params, kv_params=None) -> None:
        request = Request(
            request_id, list(prompt_token_ids), sampling_params, eos_token_ids=self.eos
        )
        self.stop_checker.start(request)
        self.requests[request_id] = request

    def abort_request(self, request_id: str) -> bool:
        return self.requests.pop(request_id, None) is not None

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[EngineOutput]:
        if self.host_s > 0:  # the engine's own Python work (schedule, prepare): holds the GIL
            end = time.perf_counter() + self.host_s
            while time.perf_counter() < end:
                pass
        if self.step_s > 0:
            time.sleep(self.step_s)
        self.steps += 1
        outputs = []
        n = len(self.text_ids)
        for rid, request in list(self.requests.items()):
            tok = self.text_ids[(len(request.prompt_token_ids) + len(request.output_token_ids)) % n]
            request.output_token_ids.append(tok)
            status = self.stop_checker.check(request, tok)
            done = status is not None
            if done:
                del self.requests[rid]
            outputs.append(
                EngineOutput(
                    rid, [tok], None, done, status.value if done else None,
                    request.num_prompt_tokens,
                    new_text=request.detokenizer.take_delta(done),
                    stop_reason=request.stop_reason if done else None,
                )
            )  # fmt: skip
        return outputs

    def get_stats(self) -> dict:
        return {"num_running": len(self.requests), "num_waiting": 0, "steps_by_mode": {}}

    def shutdown(self) -> None:
        pass


def load_tokenizer(name: str | None) -> Any:
    """The default GGUF's tokenizer (``None``), the FakeTokenizer of the tests (``"fake"``), or a
    ``transformers`` tokenizer by path or name."""
    if name == "fake":
        sys.path.insert(0, str(ROOT / "tests" / "entrypoints"))
        from fake_llm_engine import FakeTokenizer

        return FakeTokenizer()
    if name is None:
        from fastdeploy.model_executor.model_loader.source import resolve_model

        return resolve_model(None).load_tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name)


def prompts_for(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    """``num_prompts`` prompts of ``input_len`` random token ids in ``[10, vocab)``, seeded."""
    rng = random.Random(args.seed)
    return [
        [rng.randrange(10, vocab) for _ in range(args.input_len)] for _ in range(args.num_prompts)
    ]


def offline_rate(tokenizer: Any, args: argparse.Namespace) -> float:
    """Output tok/s of the synthetic engine stepped alone with ``concurrency`` requests."""
    from fastdeploy.core.sampling_params import SamplingParams

    engine = SyntheticEngine(tokenizer, args.step_ms / 1000, host_s=args.host_ms / 1000)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    prompts = prompts_for(args, engine.vocab_size)[: args.concurrency]
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    start, tokens = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        tokens += len(engine.step())
    return tokens / (time.perf_counter() - start)


class Profile:
    """cProfile of the asyncio thread over the timed run, written to ``path`` (no-op without);
    ``loop``: the asyncio loop when it runs on another thread than the caller's."""

    def __init__(self, path: str | None, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.path, self.loop = path, loop
        self.profiler = cProfile.Profile() if path else None

    def _on_loop(self, fn: Any) -> None:
        if self.loop is None:
            fn()
            return
        done = threading.Event()
        self.loop.call_soon_threadsafe(lambda: (fn(), done.set()))
        done.wait(10)

    def start(self) -> None:
        if self.profiler is not None:
            self._on_loop(self.profiler.enable)

    def stop(self) -> None:
        if self.profiler is not None:
            self._on_loop(self.profiler.disable)
            self.profiler.dump_stats(self.path)


class ThreadClocks:
    """CPU seconds of the asyncio thread and of the engine thread over a window."""

    def __init__(self, loop_thread_id: int, engine_thread_id: int) -> None:
        self.clocks = [time.pthread_getcpuclockid(t) for t in (loop_thread_id, engine_thread_id)]
        self.start = self.read()

    def read(self) -> list[float]:
        return [time.clock_gettime(c) for c in self.clocks]

    def elapsed(self) -> list[float]:
        return [b - a for a, b in zip(self.start, self.read())]


def run_http(tokenizer: Any, args: argparse.Namespace) -> dict:
    """The in-process server driven by ``benchmarks/sse_client.py`` in a subprocess."""
    import uvicorn

    from fastdeploy.entrypoints.engine_client.async_engine import AsyncLLMEngine
    from fastdeploy.entrypoints.openai.app import build_app

    engine = SyntheticEngine(tokenizer, args.step_ms / 1000, host_s=args.host_ms / 1000)
    async_engine = AsyncLLMEngine(engine)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = uvicorn.Config(build_app(async_engine, "synthetic"), host="127.0.0.1", port=port,
                            log_level="warning")  # fmt: skip
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline and thread.is_alive():
        time.sleep(0.05)
    if not server.started:
        raise RuntimeError("the server did not start")
    url = f"http://127.0.0.1:{port}"

    def client(num_prompts: int, concurrency: int) -> dict:
        prompts = json.dumps(prompts_for(args, engine.vocab_size)[:num_prompts])
        cmd = [sys.executable, str(ROOT / "benchmarks" / "sse_client.py"), url, str(concurrency),
               str(args.output_len)]  # fmt: skip
        done = subprocess.run(cmd, input=prompts, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"the client failed:\n{done.stderr[-2000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])

    try:
        client(min(8, args.num_prompts), min(8, args.concurrency))  # warm-up
        profile = Profile(args.profile, async_engine._loop)
        profile.start()
        clocks = ThreadClocks(thread.ident, async_engine._core.thread_id)
        steps0 = engine.steps
        result = client(args.num_prompts, args.concurrency)
        cpu = clocks.elapsed()
        profile.stop()
    finally:
        server.should_exit = True
        thread.join(10)
    return {**result, "steps": engine.steps - steps0, "asyncio_cpu_s": cpu[0],
            "engine_cpu_s": cpu[1]}  # fmt: skip


async def _consume_direct(handler: Any, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    """Closed-loop consumers of the completions handler's SSE strings, in-process (no HTTP)."""
    from fastdeploy.entrypoints.openai.protocol import CompletionRequest

    tpots, itls, tokens = [], [], 0
    queue = list(prompts)

    async def loop() -> None:
        nonlocal tokens
        while queue:
            req = CompletionRequest(prompt=queue.pop(0), max_tokens=args.output_len,
                                    temperature=0.0, ignore_eos=True, stream=True)  # fmt: skip
            times = []
            async for event in (await handler.create(req, None)).body_iterator:
                now = time.perf_counter()
                times.extend(now for _ in range(event.count('"choices": [{')))
            tokens += len(times)
            itls.extend(b - a for a, b in zip(times, times[1:]))
            if len(times) > 1:
                tpots.append((times[-1] - times[0]) / (len(times) - 1))

    start = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(args.concurrency)))
    seconds = time.perf_counter() - start
    return {"served_tok_s": tokens / seconds, "tpot_p50_ms": p50_ms(tpots),
            "itl_p50_ms": p50_ms(itls), "tokens": tokens, "seconds": seconds}  # fmt: skip


def run_direct(tokenizer: Any, args: argparse.Namespace) -> dict:
    """The completions handler and ``AsyncLLMEngine`` without HTTP, on one asyncio loop."""
    from fastdeploy.entrypoints.engine_client.async_engine import AsyncLLMEngine
    from fastdeploy.entrypoints.openai.serving_completion import OpenAIServingCompletion

    engine = SyntheticEngine(tokenizer, args.step_ms / 1000, host_s=args.host_ms / 1000)
    prompts = prompts_for(args, engine.vocab_size)

    async def main() -> dict:
        async_engine = AsyncLLMEngine(engine)
        async_engine.start()
        handler = OpenAIServingCompletion(async_engine, "synthetic")
        try:
            warm = argparse.Namespace(**{**vars(args), "concurrency": 8})
            await _consume_direct(handler, prompts[:8], warm)
            profile = Profile(args.profile)
            clocks = ThreadClocks(threading.get_ident(), async_engine._core.thread_id)
            steps0 = engine.steps
            profile.start()
            result = await _consume_direct(handler, prompts, args)
            profile.stop()
            cpu = clocks.elapsed()
        finally:
            await async_engine.shutdown()
        return {**result, "steps": engine.steps - steps0, "asyncio_cpu_s": cpu[0],
                "engine_cpu_s": cpu[1], "client_cpu_s": 0.0}  # fmt: skip

    return asyncio.run(main())


def print_table(args: argparse.Namespace, tokenizer: Any, offline: float, served: dict) -> None:
    """The run's numbers as a text table naming the host, tokenizer and workload."""
    where = "in-process consumers, no HTTP" if args.no_http else "HTTP, raw client process"
    print(
        f"\nServer overhead | {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs "
        f"| tokenizer {type(tokenizer).__name__} ({len(tokenizer)} tokens) | {args.num_prompts} "
        f"prompts, {args.concurrency} concurrent streams, input {args.input_len}, output "
        f"{args.output_len} | synthetic step {args.step_ms} ms | {where}"
    )
    per_token_us = {k: served[k] * 1e6 / max(1, served["tokens"])
                    for k in ("asyncio_cpu_s", "engine_cpu_s", "client_cpu_s")}  # fmt: skip
    rows = [
        ("offline output tok/s", f"{offline:,.0f}"),
        ("served output tok/s", f"{served['served_tok_s']:,.0f}"),
        ("served / offline", f"{served['served_tok_s'] / offline:.2f}"),
        ("TPOT p50 (ms)", f"{served['tpot_p50_ms']:.2f}"),
        ("ITL p50 (ms)", f"{served['itl_p50_ms']:.2f}"),
        ("engine steps", f"{served['steps']}"),
        ("tokens per step", f"{served['tokens'] / max(1, served['steps']):.1f}"),
        ("asyncio CPU per token (us)", f"{per_token_us['asyncio_cpu_s']:.1f}"),
        (f"asyncio CPU per {args.concurrency}-stream step (ms)",
         f"{per_token_us['asyncio_cpu_s'] * args.concurrency / 1000:.3f}"),
        ("engine thread CPU per token (us)", f"{per_token_us['engine_cpu_s']:.1f}"),
        ("client process CPU per token (us)", f"{per_token_us['client_cpu_s']:.1f}"),
    ]  # fmt: skip
    for name, value in rows:
        print(f"{name:<40} {value:>12}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="default: the default GGUF's; 'fake': the tests' character tokenizer",
    )
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--step-ms", type=float, default=1.0, help="GIL-free sleep per step")
    parser.add_argument(
        "--host-ms", type=float, default=0.0,
        help="GIL-held busy work per step before the sleep (the engine's scheduling and input "
        "preparation, which competes with the asyncio thread for the GIL)",
    )  # fmt: skip
    parser.add_argument(
        "--switch-interval", type=float, default=None,
        help="sys.setswitchinterval for the server process (seconds; Python's default 0.005)",
    )  # fmt: skip
    parser.add_argument("--no-http", action="store_true", help="drive the handlers in-process")
    parser.add_argument("--profile", default=None, help="write a cProfile of the asyncio thread")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the numbers to this file")
    return parser  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; returns ``{"offline_tok_s", **served numbers}``."""
    args = build_parser().parse_args(argv)
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    tokenizer = load_tokenizer(args.tokenizer)
    offline = offline_rate(tokenizer, args)
    served = run_direct(tokenizer, args) if args.no_http else run_http(tokenizer, args)
    print_table(args, tokenizer, offline, served)
    result = {"offline_tok_s": offline, **served}
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "result": result}))
    return result


if __name__ == "__main__":
    main()
