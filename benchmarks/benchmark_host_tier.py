"""Host KV tier bandwidth: device-to-host stores and host-to-device loads of whole KV blocks.

One command (CUDA host)::

    python benchmarks/benchmark_host_tier.py                       # Llama-3-8B KV layout
    python benchmarks/benchmark_host_tier.py --layers 30 --kv-heads 3 --head-dim 64   # SmolLM2

The pool is :class:`fastdeploy.worker.host_kv_pool.HostKVPool` (pinned host memory, merged runs of
blocks, a side stream). Blocks are shuffled (``--seed``) so runs are as short as a busy cache makes
them, or consecutive with ``--contiguous``. Each direction is timed with CUDA events as the mean of
``--iters`` runs after one warm-up; the table gives GB/s and the time per 1K tokens of KV.
"""

from __future__ import annotations

import argparse
import random

import torch

from fastdeploy.worker.host_kv_pool import HostKVPool


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--blocks", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--contiguous", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmark_host_tier.py needs a CUDA device")
    dtype = getattr(torch, args.dtype)
    device = torch.device("cuda")
    block_shape = (2, args.block_size, args.kv_heads, args.head_dim)
    n_max = max(args.blocks)
    kv = [torch.randn((n_max * 2 + 1, *block_shape), dtype=dtype, device=device)
          for _ in range(args.layers)]  # fmt: skip
    pool = HostKVPool(n_max * 2, block_shape, args.layers, dtype, device)
    rng = random.Random(args.seed)
    print(
        f"\nHost KV tier | GPU {torch.cuda.get_device_name()} | {args.layers} layers x "
        f"{args.kv_heads} KV heads x {args.head_dim} | block {args.block_size} tokens, "
        f"{pool.bytes_per_block / 2**20:.2f} MiB | {args.dtype} | "
        f"{'contiguous' if args.contiguous else 'shuffled'} blocks | mean of {args.iters}"
    )
    print(f"{'blocks':>7} {'MiB':>8} {'D2H GB/s':>9} {'H2D GB/s':>9} {'H2D ms/1K tok':>14}")
    for n in args.blocks:
        dev = list(range(1, n + 1)) if args.contiguous else rng.sample(range(1, 2 * n_max), n)
        host = list(range(n)) if args.contiguous else rng.sample(range(2 * n_max), n)
        nbytes = n * pool.bytes_per_block
        times = {}
        for name, fn in (
            ("d2h", lambda d=dev, h=host: pool.store(kv, d, h)),
            ("h2d", lambda d=dev, h=host: pool.load(kv, h, d)),
        ):
            fn()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(pool.stream)
            for _ in range(args.iters):
                fn()
            end.record(pool.stream)
            torch.cuda.synchronize()
            times[name] = start.elapsed_time(end) / args.iters / 1000
        tokens = n * args.block_size
        print(
            f"{n:>7} {nbytes / 2**20:8.1f} {nbytes / times['d2h'] / 1e9:9.1f} "
            f"{nbytes / times['h2d'] / 1e9:9.1f} {times['h2d'] * 1000 / tokens * 1000:14.3f}"
        )


if __name__ == "__main__":
    main()
