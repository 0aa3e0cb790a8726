"""Offline throughput: N requests with random input/output lengths through ``LLM.generate``.

One command, fixed seed, a warm-up, one text table naming device, model and workload::

    python benchmarks/benchmark_throughput.py --num-prompts 64 --input-len 128 --output-len 64

``--json FILE`` also writes the numbers (``step_speed_report.py`` reads it as the offline rate).

Progress goes to stderr while it runs (a CPU run takes minutes): a line before the model loads and
before the warm-up, then a tqdm bar of finished requests over the timed run; ``--disable-tqdm``
(vLLM's flag) leaves the bar out. The table goes to stdout.

Lengths are drawn uniformly from ``[len * (1 - range_ratio), len * (1 + range_ratio)]``; prompts are
random token ids; ``ignore_eos`` makes every request produce exactly its output length.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time

import torch

from fastdeploy import LLM, SamplingParams
from fastdeploy.engine.args_utils import EngineArgs


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def progress(line: str) -> None:
    """One progress line on stderr, at once (stdout holds only the table)."""
    print(line, file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--range-ratio", type=float, default=0.5)
    parser.add_argument("--bench-seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the numbers to this file")
    parser.add_argument(
        "--disable-tqdm", action="store_true", help="no progress bar over the timed run"
    )
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args()
    engine_args = EngineArgs.from_cli_args(args)

    rng = random.Random(args.bench_seed)
    progress(f"loading {engine_args.model or 'the default model'} on {device_name()} ...")
    llm = LLM(**{k: v for k, v in vars(engine_args).items()})
    vocab = llm.engine.vocab_size

    def length(n: int) -> int:
        return max(1, rng.randint(int(n * (1 - args.range_ratio)), int(n * (1 + args.range_ratio))))

    prompts = [
        [rng.randrange(vocab) for _ in range(length(args.input_len))]
        for _ in range(args.num_prompts)
    ]
    params = [
        SamplingParams(temperature=0, max_tokens=length(args.output_len), ignore_eos=True)
        for _ in prompts
    ]
    warm = min(4, len(prompts))
    progress(f"warm-up: {warm} requests ...")
    llm.generate(prompts[:warm], params[:warm], use_tqdm=False)
    progress(f"timed run: {len(prompts)} requests")

    before = dict(llm.engine.get_stats()["steps_by_mode"])
    start = time.perf_counter()
    # tqdm redraws at most every 0.1 s and only when a request finishes: no cost per step.
    outputs = llm.generate(prompts, params, use_tqdm=not args.disable_tqdm)
    elapsed = time.perf_counter() - start
    n_in = sum(len(p) for p in prompts)
    n_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    model = llm.engine.source.path
    steps = {k: v - before[k] for k, v in llm.engine.get_stats()["steps_by_mode"].items()}
    rows = [
        ("device", device_name()),
        ("model", f"{model} ({llm.engine.worker.dtype})"),
        (
            "workload",
            f"{args.num_prompts} requests, input ~{args.input_len}, output "
            f"~{args.output_len} (+-{args.range_ratio:.0%}), ignore_eos, seed "
            f"{args.bench_seed}",
        ),
        (
            "max_num_seqs / max_num_batched_tokens",
            f"{llm.engine.config.scheduler_config.max_num_seqs} / "
            f"{llm.engine.config.scheduler_config.max_num_batched_tokens}",
        ),
        ("steps by mode", json.dumps(steps)),
        ("wall time (s)", f"{elapsed:.2f}"),
        ("input tokens", str(n_in)),
        ("output tokens", str(n_out)),
        ("input tokens/s", f"{n_in / elapsed:.1f}"),
        ("output tokens/s", f"{n_out / elapsed:.1f}"),
        ("total tokens/s", f"{(n_in + n_out) / elapsed:.1f}"),
        ("requests/s", f"{len(prompts) / elapsed:.2f}"),
    ]
    width = max(len(k) for k, _ in rows)
    print("=" * (width + 50))
    for k, v in rows:
        print(f"{k:<{width}} | {v}")
    print("=" * (width + 50))
    if args.json:
        payload = {
            "device": device_name(),
            "model": str(model),
            "num_prompts": args.num_prompts,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "range_ratio": args.range_ratio,
            "max_num_seqs": llm.engine.config.scheduler_config.max_num_seqs,
            "wall_s": elapsed,
            "input_tokens": n_in,
            "output_tokens": n_out,
            "output_tok_s": n_out / elapsed,
            "steps_by_mode": steps,
        }
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=1)


if __name__ == "__main__":
    main()
