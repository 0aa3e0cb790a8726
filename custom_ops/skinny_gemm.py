"""``y = x @ w.T`` for a few rows of ``x`` (a decode step, a short prefill): a Triton kernel that
reads the weight at the GPU's memory bandwidth.

At one to sixteen tokens a linear layer is a matrix-vector product: it reads its whole weight and
does almost no arithmetic, so its time is the weight's bytes over the memory bandwidth. cuBLAS
tiles such a product by 64 or 128 output rows, which leaves the smaller projections of a layer
with fewer tiles than the GPU has SMs (a Llama-3-8B query/key/value projection at batch 1:
48 to 96 tiles on an H200's 132 SMs), or splits ``K`` and adds a reduction kernel. Here one program
owns a block of 16 to 64 output rows over the whole ``K`` (no split, no second kernel), so a
4,096-row projection runs as 128 programs or more, each streaming its rows through a software
pipeline; :func:`pick_config` picks the block per weight shape, or leaves the shape to cuBLAS.
The rows of ``x`` (at most :data:`MAX_ROWS`) are padded to one 16-row tile of a tensor-core
``dot``; their loads hit L2.

The result equals ``torch.nn.functional.linear(x, w)`` up to float32 summation order (products
and sums in float32, rounded once to the output dtype), as cuBLAS computes it.

A SwiGLU MLP's merged gate/up projection can end in its activation:
:func:`skinny_gated_silu_launch` gives each program the same block of gate rows and of up rows
and writes ``silu(gate) * up`` (``[M, I]``) instead of ``[gate | up]`` (``[M, 2I]``), which saves
the activation's kernel and its round trip through memory. Each output is formed once, in the
epilogue (a prologue in the down projection would make every program recompute the activation of
the whole row: measured 5 to 8 times slower on an H200).

On sm90 and newer a launch may be a programmatic dependent launch (PDL, ``pdl=True``; CUDA
programming guide, "Programmatic Dependent Launch and Synchronization"): the kernel lets the next
kernel of the stream be launched at once (``griddepcontrol.launch_dependents``) and itself waits
for the previous one to finish (``griddepcontrol.wait``) before it reads ``x``, so a decode step's
chain of small kernels no longer pays a launch gap at each boundary (where the next kernel is a
PDL launch too, as flashinfer's kernels are on sm90). Measured on an H200
(``benchmark_peers.py``, graph decode): Llama-3-8B at batch 1 4.52 -> 4.44 ms a step,
SmolLM2-135M 1.05 -> 0.85 ms. The layers launch so where :func:`pdl_supported` and
``FD_SKINNY_GEMM_PDL`` (on by default) allow it.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

try:  # Triton ships with CUDA builds of torch; CPU CI has none and uses the reference.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installed torch build
    triton = None
    tl = None

__all__ = [
    "MAX_ROWS",
    "gated_silu_reference",
    "pick_config",
    "pick_gated_config",
    "pdl_supported",
    "skinny_gated_silu_launch",
    "skinny_linear_launch",
    "skinny_linear_triton",
    "supported",
    "use_gated_silu",
    "use_skinny",
]

#: Most rows of ``x`` the kernel takes (one tensor-core tile); more rows go to cuBLAS.
MAX_ROWS = 16
#: The default tiling, ``(BLOCK_N output rows per program, BLOCK_K columns per pipeline stage,
#: warps, pipeline stages)``; :func:`pick_config` chooses one per weight shape.
DEFAULT_CONFIG = (32, 128, 4, 4)


@functools.lru_cache(maxsize=256)
def pick_config(n: int, k: int) -> tuple[int, int, int, int] | None:
    """The tiling for a ``[n, k]`` weight, or None where cuBLAS was faster.

    From a sweep of 21 tilings on an H200 (bf16, 1 and 16 rows;
    ``benchmarks/benchmark_kernels.py --sweep``) over the projections of SmolLM2-135M and
    Llama-3-8B; each rule names the shape it was measured on (times at one row). Other GPUs get
    the same tilings (correct everywhere, tuned for the H200 only):

    * ``n >= 32768`` (measured on vocabulary heads; it also takes other projections that wide,
      such as a 70B model's gate/up, unmeasured): 64 rows, 128 columns (Llama-3-8B's head,
      236.7 us against cuBLAS's 246.9 at one row); with ``k < 2048`` cuBLAS (SmolLM2-135M's
      head: 16.4 us against 17.2);
    * ``k >= 8192``: 32 rows, 512 columns (Llama-3-8B down, 30.7 us against 32.1);
    * ``k <= 1024``: 128 columns, 3 stages, and 16 rows where ``n <= 1024`` (SmolLM2-135M q/k/v,
      2.8 us against 3.9) or else 32 (its gate/up);
    * ``k <= 2048``: 16 rows, 256 columns (SmolLM2-135M down, 4.3 us against 4.9);
    * at most 4,096 rows: 32 rows, 128 columns (Llama-3-8B o, 9.3 us against 11.0);
    * at most 8,192 rows: 64 rows, 512 columns, 3 stages (Llama-3-8B q/k/v, equal at one row,
      15.2 against 15.9 us at 16 rows);
    * else 32 rows, 128 columns, 3 stages (Llama-3-8B gate/up, 56.2 against 57.0 us).
    """
    if n >= 32768:
        return (64, 128, 4, 4) if k >= 2048 else None
    if k >= 8192:
        return (32, 512, 4, 4)
    if k <= 1024:
        return (16, 128, 4, 3) if n <= 1024 else (32, 128, 4, 3)
    if k <= 2048:
        return (16, 256, 4, 4)
    if n <= 4096:
        return DEFAULT_CONFIG
    if n <= 8192:
        return (64, 512, 4, 3)
    return (32, 128, 4, 3)


@functools.lru_cache(maxsize=16)
def _tensor_core_dot(device_index: int) -> bool:
    """Whether the GPU has the compute capability (8.0, Ampere) that Triton's bf16 ``dot``
    needs."""
    return torch.cuda.get_device_capability(device_index) >= (8, 0)


@functools.lru_cache(maxsize=16)
def pdl_supported(device_index: int) -> bool:
    """Whether launches on CUDA device ``device_index`` can be programmatic dependent launches:
    compute capability 9.0 (Hopper) or newer, and Triton 3.4 or newer (``gdc_wait`` and the
    ``launch_pdl`` launch option; 3.3 has ``gdc_*`` but may drop the unused trigger)."""
    if triton is None:
        return False
    try:
        major, minor = (int(p) for p in triton.__version__.split(".")[:2])
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    except (ImportError, ValueError):
        return False
    return (major, minor) >= (3, 4) and torch.cuda.get_device_capability(device_index) >= (9, 0)


def supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`skinny_linear_triton` can take ``x @ weight.T``: CUDA (compute capability
    8.0 or newer), Triton, 2-D ``x`` of 1 to :data:`MAX_ROWS` rows with unit inner stride, a
    contiguous half-precision ``[N, K]`` weight of ``x``'s dtype on ``x``'s device."""
    return (
        triton is not None
        and x.dim() == 2
        and 0 < x.shape[0] <= MAX_ROWS
        and x.is_cuda
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and weight.dim() == 2
        and weight.shape[1] == x.shape[1]
        and x.stride(1) == 1
        and weight.is_contiguous()
        and x.device == weight.device
        and _tensor_core_dot(x.device.index if x.device.index is not None else 0)
    )


def use_skinny(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the layers send ``x @ weight.T`` to the kernel: :func:`supported`, and
    :func:`pick_config` has a tiling for the weight's shape (else cuBLAS was faster)."""
    return supported(x, weight) and pick_config(weight.shape[0], weight.shape[1]) is not None


@functools.lru_cache(maxsize=256)
def pick_gated_config(n: int, k: int) -> tuple[int, int, int, int] | None:
    """The tiling of :func:`skinny_gated_silu_launch` for a merged ``[n, k]`` gate/up weight
    (``n = 2I``; ``block_n`` counts output columns, so a program reads ``2 * block_n`` weight
    rows), or None where :func:`pick_config` leaves the plain projection to cuBLAS.

    From a sweep of 9 tilings on an H200 (bf16, 1 and 16 rows), against the plain kernel plus
    flashinfer's ``silu_and_mul``:

    * ``k >= 2048``: 32 columns, 256 deep, 3 stages (Llama-3-8B, 56.6 us against 60.0 at one
      row, 57.7 against 62.6 at 16; halving :func:`pick_config`'s 32 rows to 16 columns took
      65.5);
    * else :func:`pick_config`'s tiling with its ``block_n`` as columns (SmolLM2-135M: 32, 128,
      3 stages, 3.5 us against 4.9).
    """
    config = pick_config(n, k)
    if config is None:
        return None
    return (32, 256, 4, 3) if k >= 2048 else config


def use_gated_silu(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the layers send ``silu_and_mul(x @ weight.T)`` to
    :func:`skinny_gated_silu_launch`: :func:`use_skinny`, with an even number of weight rows."""
    return weight.dim() == 2 and weight.shape[0] % 2 == 0 and use_skinny(x, weight)


def gated_silu_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """What :func:`skinny_gated_silu_launch` computes, in torch (any device and dtype): the
    projection ``x @ weight.T`` rounded to ``x``'s dtype, then ``silu(gate) * up`` in float32
    rounded once more (flashinfer's ``silu_and_mul``).

    Args:
        x: ``[..., K]``.
        weight: ``[2I, K]`` of ``x``'s dtype, gate rows first.

    Returns:
        ``[..., I]`` of ``x``'s dtype.
    """
    gate, up = F.linear(x, weight).float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


if triton is not None:

    @triton.jit
    def _skinny_gemm_kernel(
        x_ptr,  # [M, K], rows stride_xm apart, unit inner stride
        w_ptr,  # [N, K] contiguous
        y_ptr,  # [M, N], rows stride_ym apart, unit inner stride
        M,
        N,
        K,
        stride_xm,
        stride_ym,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        EVEN_K: tl.constexpr,
        EVEN_N: tl.constexpr,
        GATED: tl.constexpr,  # w is [2N, K] (gate rows, then up rows); y = silu(gate) * up
        PDL: tl.constexpr,  # launched as a programmatic dependent launch (sm90+)
    ):
        if PDL:
            # Let the next kernel launch now, then wait for the previous one (x is its output)
            # before any global memory access. Safe because a PDL-launched successor waits
            # (griddepcontrol.wait) for this whole grid to finish and its writes to be visible
            # before it touches memory, as ours and flashinfer's kernels do; a plain launch is
            # ordered by the stream anyway. Every program must reach gdc_wait unconditionally.
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        pid = tl.program_id(0)
        rn = (pid * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        rm = tl.arange(0, BLOCK_M)
        rk = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :]
        w_ptrs = w_ptr + rn[:, None] * K + rk[None, :]
        m_mask = rm[:, None] < M
        n_mask = rn[:, None] < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if GATED:
            up_ptrs = w_ptrs + N * K
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            if EVEN_K:
                x = tl.load(x_ptrs, mask=m_mask, other=0.0)
                if EVEN_N:
                    w = tl.load(w_ptrs)
                    if GATED:
                        w_up = tl.load(up_ptrs)
                else:
                    w = tl.load(w_ptrs, mask=n_mask, other=0.0)
                    if GATED:
                        w_up = tl.load(up_ptrs, mask=n_mask, other=0.0)
            else:
                k_mask = rk[None, :] < K - k * BLOCK_K
                x = tl.load(x_ptrs, mask=m_mask & k_mask, other=0.0)
                w = tl.load(w_ptrs, mask=n_mask & k_mask, other=0.0)
                if GATED:
                    w_up = tl.load(up_ptrs, mask=n_mask & k_mask, other=0.0)
            acc = tl.dot(x, tl.trans(w), acc)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
            if GATED:
                acc_up = tl.dot(x, tl.trans(w_up), acc_up)
                up_ptrs += BLOCK_K
        if GATED:  # round each projection as the unfused path stores it, then silu_and_mul's
            gate = acc.to(y_ptr.dtype.element_ty).to(tl.float32)
            up = acc_up.to(y_ptr.dtype.element_ty).to(tl.float32)
            acc = gate * tl.sigmoid(gate) * up
        y_ptrs = y_ptr + rm[:, None] * stride_ym + rn[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask & (rn[None, :] < N))


def skinny_linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """``x [M, K] @ weight[N, K].T -> [M, N]`` on the GPU, ``M <= MAX_ROWS``; capturable in a
    CUDA graph (one kernel launch, no allocation when ``out`` is given).

    Args:
        x: float16/bfloat16 ``[M, K]``, unit inner stride.
        weight: contiguous ``[N, K]`` of ``x``'s dtype.
        out: optional ``[M, N]`` of ``x``'s dtype with unit inner stride to write into.
        config: ``(block_n, block_k, num_warps, num_stages)``; None takes
            :func:`pick_config`'s (:data:`DEFAULT_CONFIG` where that prefers cuBLAS).

    Raises:
        ValueError: inputs :func:`supported` rejects, or a wrong ``out``.
        RuntimeError: no Triton in this torch build.
    """
    if triton is None:
        raise RuntimeError("skinny_linear_triton needs Triton (a CUDA build of torch)")
    if not supported(x, weight):
        raise ValueError(
            f"skinny_linear_triton takes CUDA half-precision x [1..{MAX_ROWS}, K] with unit inner "
            f"stride and a contiguous weight [N, K] of its dtype; got x {tuple(x.shape)} "
            f"{x.dtype} on {x.device}, weight {tuple(weight.shape)} {weight.dtype}"
        )
    return skinny_linear_launch(x, weight, out, config=config)


def skinny_linear_launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    config: tuple[int, int, int, int] | None = None,
    pdl: bool = False,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """:func:`skinny_linear_triton` without its input check, for callers that already asked
    :func:`use_skinny` (the layers' ``linear``, once per call); ``out`` is still checked.
    ``pdl``: launch as a programmatic dependent launch (only where :func:`pdl_supported`).
    ``out_dtype``: ``x``'s dtype (None) or ``torch.float32``, the float32 accumulators stored
    unrounded (an LM head's logits; ``out``, when given, must be of that dtype).

    Raises:
        ValueError: a wrong ``out`` or ``out_dtype``.
    """
    config = config or pick_config(*weight.shape)
    return _launch(x, weight, out, config, gated=False, pdl=pdl, out_dtype=out_dtype)


def skinny_gated_silu_launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    config: tuple[int, int, int, int] | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """``silu_and_mul(x [M, K] @ weight[2I, K].T) -> [M, I]`` in one kernel, ``M <= MAX_ROWS``:
    a SwiGLU MLP's merged gate/up projection and its activation. Equals
    :func:`gated_silu_reference` up to float32 summation order. Capturable in a CUDA graph (one
    kernel launch, no allocation when ``out`` is given). Inputs are not checked: callers ask
    :func:`use_gated_silu` first, as :func:`skinny_linear_launch`'s callers do.

    Args:
        x: float16/bfloat16 ``[M, K]``, unit inner stride.
        weight: contiguous ``[2I, K]`` of ``x``'s dtype, the ``I`` gate rows first.
        out: optional ``[M, I]`` of ``x``'s dtype with unit inner stride to write into.
        config: ``(block_n, block_k, num_warps, num_stages)``, ``block_n`` counting output
            columns (the program reads twice as many weight rows); None takes
            :func:`pick_gated_config`'s.
        pdl: launch as a programmatic dependent launch (only where :func:`pdl_supported`).

    Raises:
        ValueError: a wrong ``out``.
    """
    config = config or pick_gated_config(*weight.shape)
    return _launch(x, weight, out, config, gated=True, pdl=pdl)


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor | None,
    config: tuple[int, int, int, int] | None,
    *,
    gated: bool,
    pdl: bool,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    m, k = x.shape
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    dtype = x.dtype if out_dtype is None else out_dtype
    if dtype not in (x.dtype, torch.float32):
        raise ValueError(f"out_dtype={out_dtype} is not allowed; allowed: {x.dtype}, float32")
    if out is None:
        out = torch.empty(m, n, dtype=dtype, device=x.device)
    elif tuple(out.shape) != (m, n) or out.dtype != dtype or out.stride(1) != 1:
        raise ValueError(
            f"out must be [{m}, {n}] {dtype} with unit inner stride, got "
            f"{tuple(out.shape)} {out.dtype} strides {out.stride()}"
        )
    block_n, block_k, num_warps, num_stages = config or DEFAULT_CONFIG
    grid = (triton.cdiv(n, block_n),)
    # launch_pdl only when set: Tritons before 3.4 reject the option even as False.
    _skinny_gemm_kernel[grid](
        x, weight, out, m, n, k, x.stride(0), out.stride(0),
        BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
        EVEN_N=n % block_n == 0, GATED=gated, PDL=pdl,
        num_warps=num_warps, num_stages=num_stages, **({"launch_pdl": True} if pdl else {}),
    )  # fmt: skip
    return out
