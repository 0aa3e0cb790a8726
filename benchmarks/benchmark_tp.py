"""Tensor parallelism: prefill and decode step latency, TP=1 vs TP=2 vs TP=2 with the fused
all-reduce + residual add + RMSNorm.

One command (a host with 2 GPUs)::

    python benchmarks/benchmark_tp.py                       # Llama-3-8B shape, dummy weights
    python benchmarks/benchmark_tp.py --tokens 16 1024 8192 --decode-batches 1 64 --iters 10

Three engines are built one after another from the same seeded dummy weights (each shut down
before the next starts): TP=1; TP=2 with NCCL all-reduce; TP=2 with flashinfer's
``trtllm_allreduce_fusion`` (``--enable-flashinfer-allreduce-fusion``). Each times whole engine
steps, ``worker.execute_model``: rank 0 sends the step to the other ranks, every rank runs it, and
rank 0 samples, so the time is what a served step costs (the step broadcast included):

* prefill: one request of N tokens (random ids), a piecewise graph replay;
* decode: B one-token requests with ``--decode-context`` tokens of KV each, a full graph replay.

Each number is the mean of ``--iters`` steps after ``--warmup``, timed on rank 0 with CUDA events
(every step ends in a host sync: rank 0 copies the sampled tokens out). CUDA graphs are captured
for exactly the measured sizes, to keep start-up short. ``--device cpu`` runs the same over gloo
without graphs (a smoke test); the fused column is then skipped with the plan's reason.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmark_prefill import DEFAULT_TOKENS, Bench, build_engine, time_ms  # noqa: E402

from fastdeploy.model_executor.model_loader.presets import PRESETS, write_preset  # noqa: E402
from fastdeploy.worker.input_batch import dummy_step  # noqa: E402

#: (column, tensor_parallel_size, enable_flashinfer_allreduce_fusion)
SETUPS = [("TP=1", 1, False), ("TP=2", 2, False), ("TP=2 fused", 2, True)]
BLOCK_SIZE = 64  # the engine's default block_size


class StepBench(Bench):
    """Times whole engine steps, so that under tensor parallelism every rank runs them."""

    def __init__(self, engine, iters: int, warmup: int, device: str) -> None:
        super().__init__(engine, iters, warmup)
        self.device = device

    def time(self, fn: Callable[[], object]) -> float:
        if self.device == "cuda":
            return time_ms(fn, self.iters, self.warmup)
        for _ in range(self.warmup):
            fn()
        start = time.perf_counter()
        for _ in range(self.iters):
            fn()
        return (time.perf_counter() - start) * 1000 / self.iters

    @torch.inference_mode()
    def run(self, sched) -> tuple[float, str]:
        """Mean milliseconds of ``sched`` as an engine step, and the graph mode it ran in."""
        mode = self.runner.dispatch(sched)[0]
        return self.time(lambda: self.engine.worker.execute_model(sched)), mode

    def prefill(self, n: int) -> tuple[float, str]:
        return self.run(self.step(n))

    def decode_sched(self, batch: int, context: int):
        return self.random_ids(dummy_step([1] * batch, self.block_size, history=context - 1))

    def decode_step(self, batch: int, context: int) -> tuple[float, str]:
        return self.run(self.decode_sched(batch, context))

    @torch.inference_mode()
    def decode_kernels(self, batch: int, context: int, top: int = 6) -> tuple[float, list]:
        """Rank 0's summed GPU kernel milliseconds of one decode step, and its ``top`` kernels
        by time as ``(name, ms, calls)``: the step's wall time minus the kernel time is what
        the host, the step broadcast and waiting on the other rank cost."""
        from torch.profiler import ProfilerActivity, profile

        sched = self.decode_sched(batch, context)
        step = lambda: self.engine.worker.execute_model(sched)  # noqa: E731
        step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        rows = [e for e in prof.key_averages() if e.device_time_total > 0]
        total = sum(e.device_time_total for e in rows) / 1000.0
        rows.sort(key=lambda e: e.device_time_total, reverse=True)
        return total, [(e.key[:60], e.device_time_total / 1000.0, e.count) for e in rows[:top]]


def measure(args, model_dir: str, tp: int, fusion: bool) -> dict:
    """Build one engine, time every size, shut it down."""
    blocks = max(
        math.ceil(max(args.tokens) / BLOCK_SIZE),
        max(args.decode_batches, default=0) * math.ceil(args.decode_context / BLOCK_SIZE),
    )
    graphs = {
        "use_cudagraph": True,
        "full_cuda_graph": False,
        "graph_opt_level": args.graph_opt_level,
        "cudagraph_capture_sizes_prefill": sorted(set(args.tokens), reverse=True),
        "cudagraph_capture_sizes": sorted(set(args.decode_batches or [1]), reverse=True),
    }
    engine = build_engine(
        args,
        model_dir,
        args.tokens,
        tensor_parallel_size=tp,
        enable_flashinfer_allreduce_fusion=fusion,
        graph_optimization_config=graphs,
        num_gpu_blocks_override=blocks + 8,
        # Room for the decode steps' context too (build_engine sizes it for the prefill).
        max_model_len=min(max(max(args.tokens), args.decode_context) + 1, 8192),
        device=args.device,
    )
    try:
        plan = engine.plan
        result = {
            "attention": engine.worker.runner.attn_backend.name,
            "fusion_reasons": [r for r in plan.reasons if r.startswith("allreduce fusion")],
        }
        if fusion and not plan.allreduce_fusion:
            return {**result, "skipped": True}
        bench = StepBench(engine, args.iters, args.warmup, args.device)
        result["prefill"] = {n: bench.prefill(n) for n in args.tokens}
        result["decode"] = {
            b: bench.decode_step(b, args.decode_context) for b in args.decode_batches
        }
        if args.device == "cuda":
            result["decode_kernels"] = {
                b: bench.decode_kernels(b, args.decode_context) for b in args.decode_batches
            }
        return result
    finally:
        engine.shutdown()


def cell(result: dict, kind: str, key: int) -> str:
    if result.get("skipped"):
        return f"{'-':>11}"
    ms, mode = result[kind][key]
    return f"{ms:10.3f}{'*' if mode == 'eager' else ' '}"


def print_table(args, results: dict[str, dict]) -> None:
    names = list(results)
    first = results[names[0]]
    gpu = (
        f"{torch.cuda.device_count()}x {torch.cuda.get_device_name()}"
        if args.device == "cuda"
        else "CPU (gloo)"
    )
    print(
        f"\nTensor parallelism | {gpu} | model {args.model} (dummy weights) | dtype {args.dtype} "
        f"| attention {first['attention']} | mean of {args.iters} steps after {args.warmup}"
    )
    head = "".join(f"{n:>11}" for n in names)
    ratios = f"{'TP2/TP1':>8}{'fused/TP2':>10}"

    def ratio_cells(kind: str, key: int) -> str:
        def ms(name: str) -> float | None:
            r = results[name]
            return None if r.get("skipped") else r[kind][key][0]

        t1, t2, tf = (ms(n) for n in ("TP=1", "TP=2", "TP=2 fused"))
        a = f"{t2 / t1:7.2f}x" if t1 and t2 else f"{'-':>8}"
        b = f"{tf / t2:9.2f}x" if t2 and tf else f"{'-':>10}"
        return a + b

    print(f"\nPrefill, 1 request of N tokens (ms per step, piecewise graphs)\n{'tokens':>7}{head}"
          f"{ratios}")  # fmt: skip
    for n in args.tokens:
        print(f"{n:>7}" + "".join(cell(results[k], "prefill", n) for k in names)
              + ratio_cells("prefill", n))  # fmt: skip
    print(f"\nDecode step, B requests with {args.decode_context} tokens of context each "
          f"(ms per step, full graphs)\n{'batch':>7}{head}{ratios}")  # fmt: skip
    for b in args.decode_batches:
        print(f"{b:>7}" + "".join(cell(results[k], "decode", b) for k in names)
              + ratio_cells("decode", b))  # fmt: skip
    print("* ran eagerly (no graph for that size)")
    kernels = {k: r["decode_kernels"] for k, r in results.items() if "decode_kernels" in r}
    if kernels:
        print(f"\nDecode step, rank 0's summed GPU kernel ms (profiler); step ms minus this is "
              f"host work, the step broadcast and waiting on the other rank\n{'batch':>7}"
              + "".join(f"{n:>11}" for n in kernels))  # fmt: skip
        for b in args.decode_batches:
            print(f"{b:>7}" + "".join(f"{kernels[k][b][0]:11.3f}" for k in kernels))
        first = args.decode_batches[0]
        for name, by_batch in kernels.items():
            print(f"{name}, batch {first}, top kernels by time:")
            for kname, ms, calls in by_batch[first][1]:
                print(f"  {ms:8.3f} ms {calls:5d}x  {kname}")
    for name in names:
        for reason in results[name]["fusion_reasons"]:
            print(f"{name}: {reason}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        default="llama3-8b",
        help=f"preset ({', '.join(PRESETS)}) or a directory with config.json",
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=DEFAULT_TOKENS)
    parser.add_argument("--decode-batches", type=int, nargs="*", default=[1, 16, 64])
    parser.add_argument("--decode-context", type=int, default=512, help="KV tokens per request")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--attention-backend", default=None)
    parser.add_argument("--graph-opt-level", type=int, choices=[0, 1, 2], default=0)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args(argv)
    args.capture_sizes = "default"  # build_engine's field; the sizes are set in measure()
    return args


def main(argv: list[str] | None = None) -> dict[str, dict]:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        raise SystemExit("benchmark_tp.py needs 2 CUDA devices (or --device cpu)")
    torch.manual_seed(0)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model if Path(args.model).is_dir() else write_preset(args.model, tmp)
        for name, tp, fusion in SETUPS:
            results[name] = measure(args, model_dir, tp, fusion)
    print_table(args, results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    return results


if __name__ == "__main__":
    main()
