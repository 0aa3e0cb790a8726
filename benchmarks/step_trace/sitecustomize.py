"""Per-step timing of the engine, for diagnosis: where a step's host time goes, served or offline.

Put this directory on ``PYTHONPATH`` and set ``STEP_TRACE`` to a path prefix; every Python process
started that way (the API server, and the engine process it spawns, which inherits both; or an
offline benchmark) times each ``LLMEngine.step`` and the parts listed in :data:`PARTS`, and writes
one JSON line per step to ``<prefix>.<pid>.jsonl`` (every 500 steps and at exit)::

    STEP_TRACE=/tmp/tr PYTHONPATH=benchmarks/step_trace python benchmarks/benchmark_throughput.py
    python benchmarks/step_trace_report.py /tmp/tr.*.jsonl

A record holds ``t0`` and ``dt`` (the step's start and duration, ``time.perf_counter`` seconds),
the step's graph ``mode``, scheduled requests ``nreq`` and tokens ``ntok``, outputs ``nout``, and
for each part that ran in the step its total seconds and its call count (``n_<part>``);
``finish`` (the step's tokens appended, stop-checked and turned into outputs) includes ``wait``,
the host's wait for those tokens (device time not hidden behind the host's work). Around the
step in the engine process's loop, served only: ``drain`` (the non-blocking application of the
commands queued before the step, adds and aborts; ``n_drain`` counts the drains that applied
any), ``stats`` (the counters read after it; also offline where the caller reads them) and
``emit`` (the send of the step message).

Requests are traced too, into ``<prefix>-req.<pid>.jsonl``, one JSON line per request and
process, with ``time.monotonic`` seconds (the clock ``time.perf_counter`` also reads on Linux, so
a client's times compare; ``benchmark_serving.py --json`` keeps each request's ``start`` and
``request_id``): in the API server process ``create`` (the handler began), ``admit`` (queued),
``first_end``/``fin_end`` (the engine's end of the step that gave the first/last output, from
the step message), ``first_recv``/``fin_recv`` (the message reached the asyncio thread) and
``sse_first``/``sse_end`` (the first event and the closing one left the stream); in the engine
process ``add`` (the loop applied the request). ``benchmarks/request_trace_report.py`` joins
them into the hops of a request.

It wraps the methods by name, from outside the package (nothing in ``fastdeploy`` changes): a part
whose method is gone or renamed is reported on stderr as skipped and left out. The wrappers cost
about a microsecond a call; compare traced runs with traced runs. Another ``sitecustomize`` later
on the path is shadowed by this one. Every Python process started with the variable and the path
imports the engine (and torch) at start, so set them for the traced command only; give the path
as an absolute one where the command may run from another directory.

The trace holds every step the process ran, warm-up included: ``benchmark_throughput.py``'s
warm-up ``generate()`` of 4 prompts, a serving benchmark's warm-up requests (``--skip-s`` of the
report drops the first seconds). A prefix without a file name (``/tmp/dir/``) or in a directory
that cannot be written is refused at start, with a line on stderr; a write that fails later stops
the trace, never the traced process.
"""

from __future__ import annotations

import atexit
import contextvars
import importlib
import json
import os
import sys
import time

#: label -> (module, class, method) timed inside a step.
PARTS = {
    "schedule": ("fastdeploy.scheduler.scheduler", "Scheduler", "schedule"),
    "launch": ("fastdeploy.worker.gpu_model_runner", "GPUModelRunner", "execute_model_async"),
    "prepare": ("fastdeploy.worker.input_batch", "InputBuffers", "prepare"),
    "replay_full": (
        "fastdeploy.model_executor.graph_optimization.graph_runner",
        "CudaGraphRunner",
        "replay_full",
    ),
    "replay_pw": (
        "fastdeploy.model_executor.graph_optimization.graph_runner",
        "CudaGraphRunner",
        "replay_piecewise",
    ),
    "plan_gd": (
        "fastdeploy.model_executor.layers.attention.flashinfer_backend",
        "FlashInferAttentionBackend",
        "plan_graph_decode",
    ),
    "plan": (
        "fastdeploy.model_executor.layers.attention.flashinfer_backend",
        "FlashInferAttentionBackend",
        "_plan",
    ),
    "plan_dec_direct": (
        "fastdeploy.model_executor.layers.attention.flashinfer_plan",
        "GraphDecodePlanner",
        "plan",
    ),
    "build_md": (
        "fastdeploy.model_executor.layers.attention.flashinfer_backend",
        "FlashInferAttentionBackend",
        "build_metadata",
    ),
    "samp_prep": ("fastdeploy.worker.sampling_buffers", "SamplingBuffers", "prepare"),
    "sampler": ("fastdeploy.model_executor.layers.sampler", "Sampler", "__call__"),
    "logits": ("fastdeploy.model_executor.models.llama", "DecoderForCausalLM", "compute_logits"),
    "logits_pw": (  # a piecewise step's sampled rows from their graph (no compute_logits call)
        "fastdeploy.model_executor.graph_optimization.graph_runner",
        "CudaGraphRunner",
        "sampled_logits",
    ),
    "out_stage": ("fastdeploy.worker.async_output", "OutputStager", "stage"),
    "result": ("fastdeploy.worker.async_output", "PendingOutput", "result"),
    "wait": ("fastdeploy.worker.async_output", "PendingOutput", "_wait"),  # for the tokens
    "finish": ("fastdeploy.engine.step_pipeline", "StepPipeline", "finish"),
}
#: Steps buffered before a write.
FLUSH_EVERY = 500

_prefix = os.environ.get("STEP_TRACE")
_current: dict = {}
_before: dict = {}  # parts timed between steps, for the next step's record
_records: list[dict] = []
_clock = time.perf_counter
_open_reqs: dict[str, dict] = {}  # request id -> its events so far (this process)
_done_reqs: list[dict] = []
_handler_start: contextvars.ContextVar = contextvars.ContextVar("step_trace_create", default=None)


def _path() -> str:
    return f"{_prefix}.{os.getpid()}.jsonl"


def _flush() -> None:
    """Append the buffered records; a failed write is reported once and ends the trace, never
    the traced process (the engine calls this inside its step)."""
    if _records and _prefix:
        _append(_path(), _records)
    _records.clear()


def _append(path: str, records: list[dict]) -> None:
    """Append ``records`` to ``path`` as JSON lines; on a failed write, say so once and end the
    trace (``_prefix`` None)."""
    global _prefix
    try:
        with open(path, "a") as out:
            out.writelines(json.dumps(r) + "\n" for r in records)
    except OSError as e:
        print(f"step trace: stopped, cannot write {path} ({e})", file=sys.stderr)
        _prefix = None


def _req_path() -> str:
    return f"{_prefix}-req.{os.getpid()}.jsonl"


def _flush_reqs(everything: bool = False) -> None:
    """Append the closed request records (and the open ones when ``everything``, at exit)."""
    if everything:
        _done_reqs.extend(_open_reqs.values())
        _open_reqs.clear()
    if _done_reqs and _prefix:
        _append(_req_path(), _done_reqs)
    _done_reqs.clear()


def _req_event(rid: str, key: str, t: float) -> None:
    """Record ``key`` at ``t`` for request ``rid`` unless it has one already (first wins)."""
    ev = _open_reqs.get(rid)
    if ev is None:
        ev = _open_reqs[rid] = {"rid": rid}
    ev.setdefault(key, t)


def _req_done(ev: dict) -> None:
    """Queue a finished record for the file, writing every :data:`FLUSH_EVERY` of them."""
    _done_reqs.append(ev)
    if len(_done_reqs) >= FLUSH_EVERY:
        _flush_reqs()


def _req_close(rid: str) -> None:
    ev = _open_reqs.pop(rid, None)
    if ev is not None:
        _req_done(ev)


def _install_requests() -> None:
    """The request events of the module docstring: the engine loop's here, the API server's
    when its first ``AsyncLLMEngine`` is made (only a server process imports those modules)."""
    from fastdeploy.engine import engine_loop
    from fastdeploy.entrypoints.engine_client import async_engine

    add = engine_loop.EngineLoop._add

    def traced_add(self, cmd, *args, **kwargs):
        _req_done({"rid": cmd.request_id, "add": time.monotonic()})
        return add(self, cmd, *args, **kwargs)

    engine_loop.EngineLoop._add = traced_add
    init = async_engine.AsyncLLMEngine.__init__

    def traced_init(self, *args, **kwargs):
        async_engine.AsyncLLMEngine.__init__ = init
        try:
            _install_server(async_engine)
        except (ImportError, AttributeError) as e:  # a part the code no longer has
            print(f"step trace: server request events skipped ({e})", file=sys.stderr)
        init(self, *args, **kwargs)

    async_engine.AsyncLLMEngine.__init__ = traced_init
    atexit.register(_flush_reqs, True)


def _install_server(async_engine) -> None:
    """The API server process's request events (see :func:`_install_requests`)."""
    from fastdeploy.entrypoints.openai import serving_chat, serving_completion, serving_utils

    for cls in (serving_completion.OpenAIServingCompletion, serving_chat.OpenAIServingChat):
        create = cls.create

        async def traced_create(self, *args, _inner=create, **kwargs):
            token = _handler_start.set(time.monotonic())
            try:
                return await _inner(self, *args, **kwargs)
            finally:
                _handler_start.reset(token)

        cls.create = traced_create
    admit = serving_utils.OpenAIServing.admit

    def traced_admit(self, request_id, *args, **kwargs):
        now = time.monotonic()
        _req_event(request_id, "create", _handler_start.get() or now)
        _req_event(request_id, "admit", now)
        return admit(self, request_id, *args, **kwargs)

    serving_utils.OpenAIServing.admit = traced_admit
    on_step = async_engine.AsyncLLMEngine._on_step

    def traced_on_step(self, outputs, stats, now, *args, **kwargs):
        t = time.monotonic()
        for o in outputs:
            _req_event(o.request_id, "first_end", now)
            _req_event(o.request_id, "first_recv", t)
            if o.finished:
                _req_event(o.request_id, "fin_end", now)
                _req_event(o.request_id, "fin_recv", t)
        return on_step(self, outputs, stats, now, *args, **kwargs)

    async_engine.AsyncLLMEngine._on_step = traced_on_step
    for module in (serving_completion, serving_chat):
        events = module.stream_events

        def traced_events(stream, *args, _inner=events, **kwargs):
            rid = stream.request_id

            async def timed():
                async for chunk in _inner(stream, *args, **kwargs):
                    if chunk and "first_recv" in _open_reqs.get(rid, ()):  # not chat's role
                        _req_event(rid, "sse_first", time.monotonic())
                    yield chunk
                _req_event(rid, "sse_end", time.monotonic())
                _req_close(rid)

            return timed()

        module.stream_events = traced_events


def _wrap(label: str, module: str, cls_name: str, method: str) -> None:
    try:
        cls = getattr(importlib.import_module(module), cls_name)
        inner = getattr(cls, method)
    except (ImportError, AttributeError) as e:  # a part the code no longer has
        print(f"step trace: {label} skipped ({e})", file=sys.stderr)
        return

    def timed(*args, **kwargs):
        start = _clock()
        try:
            return inner(*args, **kwargs)
        finally:
            _current[label] = _current.get(label, 0.0) + _clock() - start
            _current["n_" + label] = _current.get("n_" + label, 0) + 1

    timed.__wrapped__ = inner
    setattr(cls, method, timed)


def _wrap_loop(llm_engine) -> None:
    """Time the served engine loop's drain (before a step) and the counters (after it)."""
    from fastdeploy.engine import engine_loop

    loop = engine_loop.EngineLoop
    drain = loop._drain

    def traced_drain(self, block, *args, **kwargs):
        start = _clock()
        changed = drain(self, block, *args, **kwargs)
        if not block:  # a blocking drain waited for work: idle time, not the loop's cost
            _before["drain"] = _before.get("drain", 0.0) + _clock() - start
            _before["n_drain"] = _before.get("n_drain", 0) + bool(changed)
        return changed

    loop._drain = traced_drain
    get_stats = llm_engine.get_stats

    def traced_stats(self, *args, **kwargs):
        start = _clock()
        try:
            return get_stats(self, *args, **kwargs)
        finally:
            if _records and "stats" not in _records[-1]:
                _records[-1]["stats"] = _clock() - start

    llm_engine.get_stats = traced_stats


def _install() -> None:
    from fastdeploy.engine import engine as engine_module
    from fastdeploy.worker import gpu_model_runner

    for label, (module, cls_name, method) in PARTS.items():
        _wrap(label, module, cls_name, method)

    runner = gpu_model_runner.GPUModelRunner
    forward = runner.forward

    def traced_forward(self, sched, *args, **kwargs):
        out = forward(self, sched, *args, **kwargs)
        _current.update(mode=out[2], nreq=len(sched.scheduled), ntok=sched.num_batched_tokens)
        return out

    runner.forward = traced_forward
    llm_engine = engine_module.LLMEngine
    step = llm_engine.step

    def traced_step(self):
        _current.clear()
        _current.update(_before)
        _before.clear()
        start = _clock()
        outputs = step(self)
        if _prefix:
            _current.update(t0=start, dt=_clock() - start, nout=len(outputs))
            _records.append(dict(_current))
            if len(_records) >= FLUSH_EVERY:
                _flush()
        return outputs

    llm_engine.step = traced_step
    atexit.register(_flush)  # before the loop's parts: a part that cannot be wrapped loses none
    from fastdeploy.core.messages import StepOutputs
    from fastdeploy.engine import engine_core_proc

    emitter = engine_core_proc.PipeEmitter
    call = emitter.__call__

    def traced_call(self, message):
        start = _clock()
        try:
            return call(self, message)
        finally:
            if isinstance(message, StepOutputs) and _records:
                _records[-1]["emit"] = _clock() - start

    emitter.__call__ = traced_call
    try:
        _wrap_loop(llm_engine)
    except (ImportError, AttributeError) as e:  # a part the code no longer has
        print(f"step trace: drain and stats skipped ({e})", file=sys.stderr)


if _prefix:
    try:
        # Fail here, not inside a step, when the file cannot be written (it is created only when
        # steps come: the server's process writes none, its engine process does).
        folder = os.path.dirname(_prefix) or "."
        if not (os.path.basename(_prefix) and os.path.isdir(folder) and os.access(folder, os.W_OK)):
            raise OSError(
                f"STEP_TRACE={_prefix!r}: need a file name prefix in a writable directory"
            )
        _install()
        _install_requests()
    except Exception as e:  # noqa: BLE001 - a diagnostic must not stop the process it watches
        print(f"step trace: not installed ({e})", file=sys.stderr)
