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
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
from pathlib import Path

import torch

from fastdeploy.engine.args_utils import EngineArgs
from fastdeploy.engine.engine import LLMEngine
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


class Bench:
    """Times the three modes for one engine. Every timed forward runs in inference mode: the
    parameters require grad, and autograd would keep every layer's activations alive (54 GB at
    8,192 tokens of Qwen3-30B-A3B)."""

    def __init__(self, engine: LLMEngine, iters: int, warmup: int) -> None:
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

    @torch.inference_mode()
    def eager(self, n: int) -> float:
        sched = self.step(n)
        self.runner.graph_runner = None
        try:
            return time_ms(lambda: self.runner.forward(sched), self.iters, self.warmup)
        finally:
            self.runner.graph_runner = self.graphs

    @torch.inference_mode()
    def piecewise(self, n: int) -> float | None:
        sched = self.step(n)
        if self.graphs is None or self.runner.forward(sched)[2] != "piecewise":
            return None
        return time_ms(lambda: self.runner.forward(sched), self.iters, self.warmup)

    @torch.inference_mode()
    def decode(self, batch: int, context: int, graphs: bool) -> float:
        """Milliseconds of one whole decode step (inputs, forward, logits, greedy sampling) of
        ``batch`` requests with ``context`` tokens of KV each."""
        sched = self.random_ids(dummy_step([1] * batch, self.block_size, history=context - 1))
        self.runner.graph_runner = self.graphs if graphs else None
        try:
            return time_ms(lambda: self.runner.execute_model(sched), self.iters, self.warmup)
        finally:
            self.runner.graph_runner = self.graphs

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


def build_engine(args, model_dir: str, tokens: list[int]) -> LLMEngine:
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
        max_model_len=max(tokens) + 1 if max(tokens) + 1 <= 8192 else 8192,
        num_gpu_blocks_override=max(max(tokens) // 64 + 64, 64 * 9 + 8),
        graph_optimization_config=graph_cfg,
        attention_backend=args.attention_backend,
        skip_tokenizer_init=True,
    )
    return LLMEngine.from_engine_args(engine_args)


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
    rows = []
    for n in args.tokens:
        eager, pw = bench.eager(n), bench.piecewise(n)
        floor, how = bench.floor(n)
        rows.append(
            {
                "tokens": n,
                "eager_ms": eager,
                "piecewise_ms": pw,
                "floor_ms": floor,
                "floor_kind": how,
            }
        )
    name = args.model
    print(
        f"\nPrefill latency, 1 request | GPU {torch.cuda.get_device_name()} | model {name} "
        f"(dummy weights) | dtype {args.dtype} | attention {engine.worker.runner.attn_backend.name}"
        f" | graph_opt_level {args.graph_opt_level}"
        f" | mean of {args.iters} after {args.warmup} warm-up"
    )
    moe = moe_summary(engine.worker.runner.model)
    if moe:
        print(moe)
    print(
        f"{'tokens':>7} {'eager ms':>9} {'piecewise':>10} {'floor ms':>9} {'eager/pw':>9} "
        f"{'pw/floor':>9}"
    )
    for r in rows:
        pw = r["piecewise_ms"]
        pw_s = f"{pw:10.3f}" if pw else f"{'eager':>10}"
        sp = f"{r['eager_ms'] / pw:8.2f}x" if pw else f"{'-':>9}"
        fl = f"{pw / r['floor_ms']:8.2f}x" if pw else f"{'-':>9}"
        mark = "" if r["floor_kind"] == "graph" else " (floor: kernel sum)"
        print(f"{r['tokens']:>7} {r['eager_ms']:9.3f} {pw_s} {r['floor_ms']:9.3f} {sp} {fl}{mark}")
    if graphs is not None:
        print(
            f"capture: {graphs.num_graphs()} graphs ({len(graphs.piecewise)} prefill buckets, "
            f"{len(graphs.full)} decode buckets) in {graphs.capture_seconds:.2f} s, graph memory "
            f"{graphs.memory_bytes / 2**20:.1f} MiB"
        )
    result = {"rows": rows, "decode": []}
    if args.decode_batches:
        print(
            f"\nDecode step, {args.decode_context} tokens of context per request (inputs, "
            "forward, logits, greedy sampling)"
        )
        print(
            f"{'batch':>6} {'eager ms':>9} {'eager tok/s':>12} {'graph ms':>9} {'graph tok/s':>12}"
        )
        for b in args.decode_batches:
            e, g = (
                bench.decode(b, args.decode_context, False),
                bench.decode(b, args.decode_context, True),
            )
            print(f"{b:>6} {e:9.3f} {b / e * 1000:12.0f} {g:9.3f} {b / g * 1000:12.0f}")
            result["decode"].append({"batch": b, "eager_ms": e, "graph_ms": g})
    if args.all_buckets and graphs is not None:
        worst = []
        for n in sorted(graphs.piecewise):
            e, p = bench.eager(n), bench.piecewise(n)
            worst.append((p / e, n, e, p))
        worst.sort(reverse=True)
        slower = [w for w in worst if w[0] > 1.02]
        print(
            f"all {len(worst)} prefill buckets: worst piecewise/eager = {worst[0][0]:.3f} at "
            f"{worst[0][1]} tokens; buckets more than 2% slower than eager: "
            f"{[w[1] for w in slower] or 'none'}"
        )
        result["all_buckets"] = [
            {"tokens": n, "eager_ms": e, "piecewise_ms": p}
            for _, n, e, p in sorted(worst, key=lambda w: w[1])
        ]
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    engine.shutdown()


if __name__ == "__main__":
    main()
