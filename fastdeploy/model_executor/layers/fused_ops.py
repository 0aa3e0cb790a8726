"""Which elementwise layers run as flashinfer's fused kernels.

RMSNorm, fused add + RMSNorm, rotary embedding and SiLU-and-multiply each run as one flashinfer
kernel on CUDA (``flashinfer.norm.rmsnorm``, ``flashinfer.norm.fused_add_rmsnorm``,
``flashinfer.rope.apply_rope_with_cos_sin_cache_inplace``, ``flashinfer.activation.silu_and_mul``)
instead of the torch reference ops that the layers keep for the CPU, which launch several
elementwise kernels each. The layers ask :func:`use_flashinfer` per call; the answer for a
device is decided once per process (flashinfer installed, ``FD_USE_FUSED_OPS`` not off), so
the check costs a dict lookup, and CUDA graphs capture whichever path ran. Segments that
``torch.compile`` traces (``graph_opt_level`` 1 and 2) always take the torch ops, so their
numbers may differ slightly from eager steps' (greedy tests allow bf16 near-ties).
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from fastdeploy import envs

#: The dtypes flashinfer's norm, rotary and activation kernels dispatch on; a float32 model on
#: CUDA (``--dtype float32``) takes the torch reference ops (flashinfer 0.5's ``rmsnorm`` raises
#: "failed to dispatch data type" for it).
FUSED_DTYPES = (torch.float16, torch.bfloat16)


@functools.lru_cache(maxsize=1)
def fused_ops_enabled() -> bool:
    """Whether the fused flashinfer ops are on for CUDA tensors in this process: flashinfer is
    installed and ``FD_USE_FUSED_OPS`` is not off. Cached; :func:`reset` re-reads it.

    Raises:
        ValueError: ``FD_USE_FUSED_OPS`` is set to a value that is not a boolean.
    """
    return envs.FD_USE_FUSED_OPS() and importlib.util.find_spec("flashinfer") is not None


def reset() -> None:
    """Forget the cached answer of :func:`fused_ops_enabled` (tests and benchmarks that flip
    ``FD_USE_FUSED_OPS`` before building a model)."""
    fused_ops_enabled.cache_clear()


def use_flashinfer(x: torch.Tensor) -> bool:
    """True when ``x`` is on CUDA, of a dtype in :data:`FUSED_DTYPES`, the fused ops are on
    (:func:`fused_ops_enabled`) and no ``torch.compile`` is tracing: segments compiled at
    ``graph_opt_level`` 1 and 2 keep the torch reference ops, which Inductor fuses its own way
    (dynamo cannot trace flashinfer's JIT-loaded functions, nor the environment variable behind
    :func:`fused_ops_enabled`)."""
    return (
        x.is_cuda
        and x.dtype in FUSED_DTYPES
        and not torch.compiler.is_compiling()
        and fused_ops_enabled()
    )


def why_not_fused(device_type: str, dtype: torch.dtype | None = None) -> str | None:
    """Why the fused ops are off on ``device_type`` (``cuda``/``cpu``) for a model of ``dtype``
    (None: any of :data:`FUSED_DTYPES`); None when they are on."""
    if device_type != "cuda":
        return f"device is {device_type}: torch reference ops"
    if dtype is not None and dtype not in FUSED_DTYPES:
        return f"dtype is {dtype}: flashinfer's kernels take float16 and bfloat16 only"
    if not envs.FD_USE_FUSED_OPS():
        return "FD_USE_FUSED_OPS=0"
    if importlib.util.find_spec("flashinfer") is None:
        return "flashinfer is not installed"
    return None
