"""Greedy sampling's argmax over the vocabulary, as two Triton kernels spread over the GPU.

``torch.argmax(logits, dim=-1)`` reduces each row of ``[B, V]`` logits within few thread blocks:
at batch 1 one row of 128,256 logits (Llama-3's vocabulary) took 26 us of an H200's time, about
a whole Llama-3-8B layer's attention (``benchmarks/benchmark_kernels.py``). Here the first kernel
splits every row into :data:`CHUNK`-wide chunks, one program each, and keeps each chunk's
maximum, its first index and whether the chunk holds a NaN (and where the first one is); the
second picks, per row, the first chunk holding a NaN, or else the first chunk holding the row's
maximum. So the result is ``torch.argmax``'s: the first NaN when a row has one (NaN counts as
larger than every number, ``+inf`` included), else the first index of the maximum.
"""

from __future__ import annotations

import torch

try:  # Triton ships with CUDA builds of torch; CPU CI has none and uses torch.argmax.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installed torch build
    triton = None
    tl = None

__all__ = ["CHUNK", "argmax_rows", "argmax_rows_triton"]

#: Logits per program of the first kernel.
CHUNK = 4096


if triton is not None:

    @triton.jit
    def _chunk_max_kernel(
        x_ptr, max_ptr, idx_ptr, nan_ptr, V, stride_x, num_chunks, CHUNK: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)
        chunk = tl.program_id(1)
        cols = chunk * CHUNK + tl.arange(0, CHUNK)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < V, other=float("-inf"))
        x = x.to(tl.float32)
        is_nan = (x != x).to(tl.int32)
        has_nan, first_nan = tl.max(
            is_nan, axis=0, return_indices=True, return_indices_tie_break_left=True
        )
        best, at = tl.max(
            tl.where(is_nan > 0, float("-inf"), x),
            axis=0,
            return_indices=True,
            return_indices_tie_break_left=True,
        )
        at = tl.where(has_nan > 0, first_nan, at)
        out = row * num_chunks + chunk
        tl.store(max_ptr + out, best)
        tl.store(idx_ptr + out, chunk * CHUNK + at)
        tl.store(nan_ptr + out, has_nan)

    @triton.jit
    def _row_max_kernel(max_ptr, idx_ptr, nan_ptr, out_ptr, num_chunks, CHUNKS_P2: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, CHUNKS_P2)
        valid = c < num_chunks
        m = tl.load(max_ptr + row * num_chunks + c, mask=valid, other=float("-inf"))
        f = tl.load(nan_ptr + row * num_chunks + c, mask=valid, other=0)
        _, best_chunk = tl.max(m, axis=0, return_indices=True, return_indices_tie_break_left=True)
        any_nan, nan_chunk = tl.max(
            f, axis=0, return_indices=True, return_indices_tie_break_left=True
        )
        chunk = tl.where(any_nan > 0, nan_chunk, best_chunk)
        tl.store(out_ptr + row, tl.load(idx_ptr + row * num_chunks + chunk).to(tl.int64))


def _supported(x: torch.Tensor) -> bool:
    """Whether the kernels take ``x``: 2-D CUDA float32/bfloat16/float16 with ``V > 0`` and unit
    inner stride."""
    return (
        x.dim() == 2
        and x.shape[1] > 0
        and x.is_cuda
        and x.stride(1) == 1
        and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
    )


def argmax_rows_triton(x: torch.Tensor) -> torch.Tensor:
    """Index of each row's maximum: ``x [B, V]`` (CUDA, float32/bfloat16/float16, unit inner
    stride) -> int64 ``[B]``; equal to ``x.argmax(dim=-1)``, NaN and ties included. Two kernel
    launches and three small ``[B, ceil(V / CHUNK)]`` buffers; capturable in a CUDA graph.

    Raises:
        ValueError: not a 2-D CUDA tensor of those dtypes with unit inner stride, or ``V == 0``.
        RuntimeError: no Triton in this torch build.
    """
    if triton is None:
        raise RuntimeError("argmax_rows_triton needs Triton (a CUDA build of torch)")
    if not _supported(x):
        raise ValueError(
            f"argmax_rows_triton takes CUDA float32/bfloat16/float16 [B, V > 0] with unit inner "
            f"stride; got {tuple(x.shape)} {x.dtype} strides {x.stride()} on {x.device}"
        )
    rows, vocab = x.shape
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out
    num_chunks = triton.cdiv(vocab, CHUNK)
    best = torch.empty(rows, num_chunks, dtype=torch.float32, device=x.device)
    at = torch.empty(rows, num_chunks, dtype=torch.int32, device=x.device)
    nan = torch.empty(rows, num_chunks, dtype=torch.int32, device=x.device)
    _chunk_max_kernel[(rows, num_chunks)](
        x, best, at, nan, vocab, x.stride(0), num_chunks, CHUNK=CHUNK
    )
    chunks_p2 = max(triton.next_power_of_2(num_chunks), 2)
    _row_max_kernel[(rows,)](best, at, nan, out, num_chunks, CHUNKS_P2=chunks_p2)
    return out


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of ``[B, V]`` logits: the Triton kernels where they take ``x`` (see
    :func:`argmax_rows_triton`), ``torch.argmax`` elsewhere (the reference)."""
    if triton is not None and _supported(x):
        return argmax_rows_triton(x)
    return x.argmax(dim=-1)
