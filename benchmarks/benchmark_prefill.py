"""Single-request prefill latency: eager vs piecewise CUDA graphs vs a no-break full graph.

One command (CUDA host)::

    python benchmarks/benchmark_prefill.py                      # SmolLM2-135M shape, dummy weights
    python benchmarks/benchmark_prefill.py --model llama3-8b --tokens 16 32 64 128
    python benchmarks/benchmark_prefill.py --model qwen3-30b-a3b   # mixture of experts

``--model`` is a preset name (see ``fastdeploy/model_executor/model_loader/presets.py``) or a
directory with a Hugging Face ``config.json``; weights are random (``load_format=dummy``), seeded.
Token ids are random too (seeded): with one repeated id every token of a mixture-of-experts model
would take the same experts, and a step would read a fraction of the expert weights it reads on
real text.
For every token count the forward (input copy, attention planning, model; no sampling) is timed
with CUDA events as the mean of ``--iters`` runs after ``--warmup`` runs:

* eager: the PyTorch modules as written;
* piecewise: replay of the captured bucket, attention run eagerly between segments;
* floor: the same forward captured as one graph with no breaks (what launch overhead can reach);
  if the attention kernels cannot be captured that way, the summed GPU kernel time of one eager
  forward from the PyTorch profiler.

The engine is built with the default capture ladders unless ``--capture-sizes tokens``; capture
time, graph count and graph memory come from that engine's warm-up.

Kernel counts (the ``krn`` columns): GPU kernels one step launches, eagerly and as replayed (a
replayed graph's kernels count one by one), from the PyTorch profiler's CUDA activities of kind
kernel (memory copies and sets not counted). They need CUDA's profiler (CUPTI), as the whole
benchmark needs CUDA; where the profiler sees no kernels the columns show ``-`` and a line says so.
The decode table's ``unfused krn`` column counts an eager step with the fused flashinfer ops off
(``FD_USE_FUSED_OPS=0``: the torch reference RMSNorm, RoPE and SiLU-and-multiply, as before they
were fused), next to the fused eager and graph counts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from fastdeploy.engine.args_utils import EngineArgs
from fastdeploy.engine.engine import LLMEngine
from fastdeploy.model_executor.layers import fused_ops
from fastdeploy.model_executor.model_loader.presets import PRESETS, write_preset
from fastdeploy.worker.input_batch import dummy_step

DEFAULT_TOKENS = [16, 64, 128, 256, 512, 1024, 2048, 4096, 8192]


def time_ms(fn, iters: int, warmup: int) -> float:
    """Mean milliseconds of ``fn()`` over ``iters`` runs (CUDA events), after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def kernel_time_ms(fn) -> float:
    """Summed device time of the CUDA kernels one call of ``fn`` launches (PyTorch profiler)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.device_time_total for e in prof.key_averages()) / 1000.0


def is_kernel(event) -> bool:
    """Whether a profiler (kineto) event is a GPU kernel, not a memory copy or set."""
    from torch.autograd import DeviceType

    if event.device_type() != DeviceType.CUDA:
        return False
    if hasattr(event, "activity_type"):
        return event.activity_type() == "kernel"
    return not event.name().startswith(("Memcpy", "Memset"))  # older torch: kineto's names


def kernel_count(fn) -> int | None:
    """GPU kernels one call of ``fn`` launches (PyTorch profiler; the kernels of a replayed CUDA
    graph count one by one), after one call outside the profile; None when the profiler saw no
    kernel at all (no CUPTI)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    n = sum(1 for e in prof.profiler.kineto_results.events() if is_kernel(e))
    return n or None


class Bench:
    """Times the three modes for one engine. Every timed forward runs in inference mode: the
    parameters require grad, and autograd would keep every layer's activations alive (54 GB at
    8,192 tokens of Qwen3-30B-A3B)."""

    def __init__(self, engine: LLMEngine, iters: int, warmup: int) -> None:
        """Each mode below takes ``measure``: a function of the step's callable, by default its
        mean milliseconds (:func:`time_ms`); :func:`kernel_count` counts its kernels instead."""
        self.vocab_size = engine.vocab_size
        self.engine = engine
        self.runner = engine.worker.runner
        self.graphs = self.runner.graph_runner
        self.iters, self.warmup = iters, warmup
        self.block_size = engine.config.cache_config.block_size

    def step(self, n: int):
        return self.random_ids(dummy_step([n], self.block_size))

    def random_ids(self, sched):
        """``sched`` with every request's token ids drawn at random (seeded by the request's
        index and length, so requests of a batch differ)."""
        for i, s in enumerate(sched.scheduled):
            req = s.request
            g = torch.Generator().manual_seed(i * 1_000_003 + req.num_prompt_tokens)
            ids = torch.randint(0, self.vocab_size, (req.num_prompt_tokens,), generator=g)
            req.prompt_token_ids = ids.tolist()
        return sched

    def time(self, fn: Callable[[], object]) -> float:
        return time_ms(fn, self.iters, self.warmup)

    @contextmanager
    def use_graphs(self, on: bool) -> Iterator[None]:
        self.runner.graph_runner = self.graphs if on else None
        try:
            yield
        finally:
            self.runner.graph_runner = self.graphs

    @torch.inference_mode()
    def eager(self, n: int, measure: Callable | None = None) -> float:
        sched = self.step(n)
        with self.use_graphs(False):
            return (measure or self.time)(lambda: self.runner.forward(sched))

    @torch.inference_mode()
    def piecewise(self, n: int, measure: Callable | None = None) -> float | None:
        sched = self.step(n)
        if self.graphs is None or self.runner.forward(sched)[2] != "piecewise":
            return None
        return (measure or self.time)(lambda: self.runner.forward(sched))

    @torch.inference_mode()
    def decode(self, batch: int, context: int, graphs: bool, measure: Callable | None = None):
        """Milliseconds (or ``measure``) of one whole decode step (inputs, forward, logits, greedy
        sampling) of ``batch`` requests with ``context`` tokens of KV each."""
        sched = self.random_ids(dummy_step([1] * batch, self.block_size, history=context - 1))
        with self.use_graphs(graphs):
            return (measure or self.time)(lambda: self.runner.execute_model(sched))

    @torch.inference_mode()
    def floor(self, n: int) -> tuple[float, str]:
        runner = self.runner
        inputs = runner.buffers.prepare(self.step(n))
        meta = runner.build_forward_meta(inputs)

        def forward():
            return runner.model(inputs.input_ids, inputs.positions, meta)

        try:
            forward()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.graphs.pool if self.graphs else None):
                forward()
            ms = time_ms(graph.replay, self.iters, self.warmup)
            del graph
            return ms, "graph"
        except Exception:  # attention not capturable without breaks: profiler floor
            torch.cuda.synchronize()
            return kernel_time_ms(forward), "kernels"


def moe_summary(model) -> str | None:
    """One line on the model's mixture-of-experts layers (None for a dense model)."""
    blocks = model.moe_blocks() if hasattr(model, "moe_blocks") else []
    if not blocks:
        return None
    b = blocks[0]
    shared = "" if b.shared_experts is None else " + shared experts"
    return (
        f"MoE: {len(blocks)} of {len(model.layers)} layers sparse, "
        f"{b.experts.num_experts} experts of {b.experts.intermediate_size}, "
        f"top-{b.routing.top_k}{shared}, fused-MoE backend {b.resolved_backend()}"
    )


def build_engine(args, model_dir: str, tokens: list[int], **engine_kwargs) -> LLMEngine:
    """The benchmark's engine for ``tokens``; ``engine_kwargs`` (``EngineArgs`` fields) override
    its settings (``benchmark_tp.py``: the tensor-parallel size, fusion, capture sizes)."""
    graph_cfg = {
        "use_cudagraph": True,
        "full_cuda_graph": False,
        "graph_opt_level": args.graph_opt_level,
    }
    if args.capture_sizes == "tokens":
        graph_cfg["cudagraph_capture_sizes_prefill"] = sorted(set(tokens), reverse=True)
        graph_cfg["cudagraph_capture_sizes"] = [1]
    engine_args = EngineArgs(
        model=model_dir,
        load_format="dummy",
        dtype=args.dtype,
        seed=0,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=max(8192, max(tokens)),
        # Room for the longest prefill and for the decode table's context (tokens all shorter
        # than --decode-context failed the decode rows: a request held more blocks than a row
        # of the block table).
        max_model_len=min(max(*tokens, getattr(args, "decode_context", 0)) + 1, 8192),
        num_gpu_blocks_override=max(max(tokens) // 64 + 64, 64 * 9 + 8),
        graph_optimization_config=graph_cfg,
        attention_backend=args.attention_backend,
        skip_tokenizer_init=True,
    )
    engine_args = dataclasses.replace(engine_args, **engine_kwargs)
    engine = LLMEngine.from_engine_args(engine_args)
    engine.finish_graph_capture()  # every graph before the timed steps (issue #47)
    return engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        default="smollm2-135m",
        help=f"preset ({', '.join(PRESETS)}) or a directory with config.json",
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=DEFAULT_TOKENS)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--capture-sizes", choices=["default", "tokens"], default="default")
    parser.add_argument(
        "--all-buckets",
        action="store_true",
        help="also time eager vs piecewise for every captured prefill bucket",
    )
    parser.add_argument("--decode-batches", type=int, nargs="*", default=[1, 16, 64])
    parser.add_argument("--decode-context", type=int, default=512, help="KV tokens per request")
    parser.add_argument("--attention-backend", default=None)
    parser.add_argument(
        "--graph-opt-level",
        type=int,
        choices=[0, 1, 2],
        default=0,
        help="1/2: segments compiled by torch.compile (2: max-autotune) before capture",
    )
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    if not torch.cuda.is_available():
        raise SystemExit("benchmark_prefill.py needs a CUDA device")
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model if Path(args.model).is_dir() else write_preset(args.model, tmp)
        engine = build_engine(args, model_dir, args.tokens)
    bench = Bench(engine, args.iters, args.warmup)
    graphs = engine.worker.runner.graph_runner
    rows = prefill_rows(bench, args.tokens)
    print(
        f"\nPrefill latency, 1 request | GPU {torch.cuda.get_device_name()} | model {args.model} "
        f"(dummy weights) | dtype {args.dtype} | attention {engine.worker.runner.attn_backend.name}"
        f" | graph_opt_level {args.graph_opt_level}"
        f" | mean of {args.iters} after {args.warmup} warm-up"
    )
    moe = moe_summary(engine.worker.runner.model)
    if moe:
        print(moe)
    print_prefill(rows)
    if graphs is not None:
        print(
            f"capture: {graphs.num_graphs()} graphs ({len(graphs.piecewise)} prefill buckets, "
            f"{len(graphs.full)} decode, {len(graphs.sampled)} sampled-row buckets) in "
            f"{graphs.capture_seconds:.2f} s, graph memory "
            f"{graphs.memory_bytes / 2**20:.1f} MiB"
        )
    result = {"rows": rows, "decode": decode_rows(bench, args.decode_batches, args.decode_context)}
    if args.all_buckets and graphs is not None:
        result["all_buckets"] = all_buckets(bench, sorted(graphs.piecewise))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    engine.shutdown()


def fmt_count(n: int | None, width: int) -> str:
    return f"{'-' if n is None else n:>{width}}"


def note_missing_counts(counts: list[int | None]) -> None:
    if any(c is None for c in counts):
        print("kernel counts '-': the profiler saw no CUDA kernels (CUPTI unavailable?)")


def prefill_rows(bench: Bench, tokens: list[int]) -> list[dict]:
    """Eager, piecewise and floor milliseconds and the kernels of one eager and one piecewise
    step, for one request of each token count."""
    rows = []
    for n in tokens:
        eager, pw = bench.eager(n), bench.piecewise(n)
        floor, how = bench.floor(n)
        rows.append(
            {
                "tokens": n,
                "eager_ms": eager,
                "piecewise_ms": pw,
                "floor_ms": floor,
                "floor_kind": how,
                "eager_kernels": bench.eager(n, kernel_count),
                "piecewise_kernels": bench.piecewise(n, kernel_count),
            }
        )
    return rows


def print_prefill(rows: list[dict]) -> None:
    print(
        f"{'tokens':>7} {'eager ms':>9} {'piecewise':>10} {'floor ms':>9} {'eager/pw':>9} "
        f"{'pw/floor':>9} {'eager krn':>9} {'pw krn':>7}"
    )
    for r in rows:
        pw = r["piecewise_ms"]
        pw_s = f"{pw:10.3f}" if pw else f"{'eager':>10}"
        sp = f"{r['eager_ms'] / pw:8.2f}x" if pw else f"{'-':>9}"
        fl = f"{pw / r['floor_ms']:8.2f}x" if pw else f"{'-':>9}"
        krn = f"{fmt_count(r['eager_kernels'], 9)} {fmt_count(r['piecewise_kernels'], 7)}"
        mark = "" if r["floor_kind"] == "graph" else " (floor: kernel sum)"
        print(
            f"{r['tokens']:>7} {r['eager_ms']:9.3f} {pw_s} {r['floor_ms']:9.3f} {sp} {fl} "
            f"{krn}{mark}"
        )
    note_missing_counts([r["eager_kernels"] for r in rows])


@contextmanager
def fused_ops_off() -> Iterator[None]:
    """Run the torch reference ops instead of flashinfer's fused ones (``FD_USE_FUSED_OPS=0``)
    inside the block; the models read the switch per call, so no rebuild is needed."""
    old = os.environ.get("FD_USE_FUSED_OPS")
    os.environ["FD_USE_FUSED_OPS"] = "0"
    fused_ops.reset()
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("FD_USE_FUSED_OPS")
        else:
            os.environ["FD_USE_FUSED_OPS"] = old
        fused_ops.reset()


def decode_rows(bench: Bench, batches: list[int], context: int) -> list[dict]:
    """Eager and graph decode steps of each batch size: milliseconds and kernels; printed."""
    if not batches:
        return []
    print(
        f"\nDecode step, {context} tokens of context per request (inputs, forward, logits, "
        "greedy sampling)"
    )
    print(
        f"{'batch':>6} {'eager ms':>9} {'eager tok/s':>12} {'graph ms':>9} {'graph tok/s':>12} "
        f"{'eager krn':>9} {'graph krn':>9} {'unfused krn':>11}"
    )
    rows = []
    for b in batches:
        e, g = bench.decode(b, context, False), bench.decode(b, context, True)
        ek = bench.decode(b, context, False, kernel_count)
        gk = bench.decode(b, context, True, kernel_count)
        with fused_ops_off():
            uk = bench.decode(b, context, False, kernel_count)
        print(
            f"{b:>6} {e:9.3f} {b / e * 1000:12.0f} {g:9.3f} {b / g * 1000:12.0f} "
            f"{fmt_count(ek, 9)} {fmt_count(gk, 9)} {fmt_count(uk, 11)}"
        )
        rows.append(
            {
                "batch": b,
                "eager_ms": e,
                "graph_ms": g,
                "eager_kernels": ek,
                "graph_kernels": gk,
                "unfused_eager_kernels": uk,
            }
        )
    note_missing_counts([r["eager_kernels"] for r in rows])
    return rows


def all_buckets(bench: Bench, buckets: list[int]) -> list[dict]:
    """Eager vs piecewise milliseconds and piecewise kernels of every captured prefill bucket;
    prints the worst ratio and the kernel range."""
    rows = [
        {
            "tokens": n,
            "eager_ms": bench.eager(n),
            "piecewise_ms": bench.piecewise(n),
            "piecewise_kernels": bench.piecewise(n, kernel_count),
        }
        for n in buckets
    ]
    worst = max(rows, key=lambda r: r["piecewise_ms"] / r["eager_ms"])
    slower = [r["tokens"] for r in rows if r["piecewise_ms"] / r["eager_ms"] > 1.02]
    print(
        f"all {len(rows)} prefill buckets: worst piecewise/eager = "
        f"{worst['piecewise_ms'] / worst['eager_ms']:.3f} at {worst['tokens']} tokens; buckets "
        f"more than 2% slower than eager: {slower or 'none'}"
    )
    counts = [r["piecewise_kernels"] for r in rows if r["piecewise_kernels"] is not None]
    if counts:
        print(f"kernels per piecewise replay: {min(counts)} to {max(counts)} over the buckets")
    return rows


if __name__ == "__main__":
    main()
