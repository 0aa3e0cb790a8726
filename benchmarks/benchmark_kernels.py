"""The project's own kernels against what they replace, on a model's shapes.

One command (CUDA host)::

    python benchmarks/benchmark_kernels.py                  # SmolLM2-135M and Llama-3-8B
    python benchmarks/benchmark_kernels.py --sweep          # also every tiling of SWEEP

Two tables. The skinny GEMM (``custom_ops/skinny_gemm.py``) against cuBLAS: for each dense
projection of each preset (``[N, K]`` weights: q/k/v, o, gate/up, down, the
vocabulary head) and each row count, it prints the microseconds of ``F.linear`` (cuBLAS, its
split-K reduction kernel included) and of the kernel with :func:`pick_config`'s tiling (``-``
where the table leaves the shape to cuBLAS), the weight's read rate in TB/s and the speed-up.
``--sweep`` adds the fastest tiling of :data:`SWEEP` per shape, which is how the table was
chosen. After each gate/up row, a ``+silu`` row: the projection with its SiLU-and-multiply,
cuBLAS then flashinfer's ``silu_and_mul`` against the gated kernel. Greedy sampling's argmax
(``custom_ops/argmax_ops.py``) against ``torch.argmax`` on bf16 logits of each preset's
vocabulary, at several batch sizes. Each time is Triton's
``do_bench_cudagraph`` (a CUDA graph of the call, replayed) with random inputs; each kernel's
result with its default tiling is first checked against the reference (the ``--sweep`` tilings
are only timed; ``tests/gpu/test_skinny_gemm_gpu.py`` checks the kernel's correctness).
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

from custom_ops.argmax_ops import argmax_rows_triton
from custom_ops.skinny_gemm import (
    gated_silu_reference,
    pick_config,
    pick_gated_config,
    skinny_gated_silu_launch,
    skinny_linear_triton,
)
from fastdeploy.model_executor.layers.activation import SiluAndMul
from fastdeploy.model_executor.model_loader.presets import PRESETS

#: Tilings ``(block_n, block_k, num_warps, num_stages)`` that ``--sweep`` tries.
SWEEP = [*itertools.product([16, 32, 64], [128, 256, 512], [4], [3, 4]),
         (16, 256, 4, 6), (32, 256, 8, 4), (16, 512, 8, 4)]  # fmt: skip


def shapes_of(preset: str) -> dict[str, tuple[int, int]]:
    """``{projection: (N, K)}`` of a dense preset's decoder layer and vocabulary head.

    Raises:
        KeyError: an unknown preset (the message lists them).
    """
    if preset not in PRESETS:
        raise KeyError(f"unknown preset {preset!r}; known: {', '.join(PRESETS)}")
    c = PRESETS[preset]
    hidden, inter = c["hidden_size"], c["intermediate_size"]
    heads, kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
    head_dim = c.get("head_dim", hidden // heads)
    return {
        "qkv": ((heads + 2 * kv_heads) * head_dim, hidden),
        "o": (hidden, heads * head_dim),
        "gate_up": (2 * inter, hidden),
        "down": (hidden, inter),
        "lm_head": (c["vocab_size"], hidden),
    }


def time_us(fn) -> float:
    """Microseconds of one call of ``fn``, replayed from a CUDA graph."""
    from triton.testing import do_bench_cudagraph

    return do_bench_cudagraph(fn, rep=20) * 1000.0


def bench_us(x: torch.Tensor, w: torch.Tensor, config: tuple | None | str = "cublas") -> float:
    """Microseconds of ``F.linear(x, w)`` (``config="cublas"``) or of the kernel with ``config``
    (None: :func:`pick_config`'s)."""
    if config == "cublas":
        return time_us(lambda: F.linear(x, w))
    return time_us(lambda: skinny_linear_triton(x, w, config=config))


def gated_row(model: str, x: torch.Tensor, w: torch.Tensor) -> str:
    """A table row for the gate/up projection with its SiLU-and-multiply: cuBLAS then
    :class:`SiluAndMul` (flashinfer's kernel) against :func:`skinny_gated_silu_launch` (checked
    against :func:`gated_silu_reference` first)."""
    act = SiluAndMul()
    want = gated_silu_reference(x, w).float()
    torch.testing.assert_close(  # within a bf16 rounding of the output's scale
        skinny_gated_silu_launch(x, w).float(), want, rtol=2**-7,
        atol=want.abs().max().item() * 2**-6,
    )  # fmt: skip
    ref = time_us(lambda: act(F.linear(x, w)))
    ours = time_us(lambda: skinny_gated_silu_launch(x, w))
    (n, k), m = w.shape, x.shape[0]
    return (
        f"{model:<14}{'+silu':<9}{f'{n} x {k}':>14}{m:>5}{ref:9.2f}{ours:9.2f}"
        f"{n * k * 2 / ours / 1e6:6.2f}{ref / ours:6.2f}x"
    )


def argmax_table(models: list[str], batches: list[int]) -> None:
    """Print ``torch.argmax`` against :func:`argmax_rows_triton` per vocabulary and batch."""
    print(f"\nGreedy argmax of bf16 logits | us per call\n{'model':<14}{'vocab':>8}{'batch':>6}"
          f"{'torch':>9}{'ours':>9}{'x':>7}")  # fmt: skip
    for model in models:
        vocab = PRESETS[model]["vocab_size"]
        for b in batches:
            x = torch.randn(b, vocab, device="cuda").to(torch.bfloat16)
            assert torch.equal(argmax_rows_triton(x), x.argmax(dim=-1))
            ref = time_us(lambda x=x: x.argmax(dim=-1))
            ours = time_us(lambda x=x: argmax_rows_triton(x))
            print(f"{model:<14}{vocab:>8}{b:>6}{ref:9.2f}{ours:9.2f}{ref / ours:6.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "llama3-8b"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--sweep", action="store_true", help="also try every tiling of SWEEP")
    parser.add_argument("--argmax-batches", type=int, nargs="*", default=[1, 16, 64])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmark_kernels.py needs a CUDA device")
    torch.manual_seed(0)
    print(f"\nSkinny GEMM vs cuBLAS | {torch.cuda.get_device_name()} | bf16 | us per call")
    head = f"{'model':<14}{'proj':<9}{'N x K':>14}{'rows':>5}{'cuBLAS':>9}{'ours':>9}{'TB/s':>6}"
    print(head + f"{'x':>7}" + ("  fastest tiling of the sweep" if args.sweep else ""))
    for model in args.models:
        for proj, (n, k) in shapes_of(model).items():
            w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k**0.5
            config = pick_config(n, k)
            for m in args.rows:
                x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
                ref = bench_us(x, w)
                line = f"{model:<14}{proj:<9}{f'{n} x {k}':>14}{m:>5}{ref:9.2f}"
                if config is None:
                    line += f"{'-':>9}{'-':>6}{'-':>7}"
                else:
                    want = F.linear(x, w).float()  # equal up to summation order:
                    torch.testing.assert_close(  # within a bf16 rounding of the output's scale
                        skinny_linear_triton(x, w).float(), want, rtol=2**-7,
                        atol=want.abs().max().item() * 2**-7,
                    )  # fmt: skip
                    ours = bench_us(x, w, None)
                    line += f"{ours:9.2f}{n * k * 2 / ours / 1e6:6.2f}{ref / ours:6.2f}x"
                if args.sweep:
                    timed = [(bench_us(x, w, c), c) for c in SWEEP]
                    best_us, best = min(timed)
                    line += f"  {best} {best_us:.2f}"
                print(line, flush=True)
                if proj == "gate_up" and pick_gated_config(n, k) is not None:
                    print(gated_row(model, x, w), flush=True)
    if args.argmax_batches:
        argmax_table(args.models, args.argmax_batches)


if __name__ == "__main__":
    main()
