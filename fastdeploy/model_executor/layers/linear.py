"""Linear projections with checkpoint-loading helpers (no tensor-parallel sharding yet).

Hugging Face checkpoints store q/k/v and gate/up as separate matrices; we store each group as one
merged weight so a step runs one matmul instead of three (the layout vLLM uses). A merged layer
knows the output rows of each *shard* and loads or exports one shard at a time.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from custom_ops.skinny_gemm import (
    pdl_supported,
    skinny_gated_silu_launch,
    skinny_linear_launch,
    use_gated_silu,
    use_skinny,
)
from fastdeploy import envs


@functools.lru_cache(maxsize=1)
def skinny_gemm_enabled() -> bool:
    """Whether ``FD_USE_SKINNY_GEMM`` is on in this process (cached; ``cache_clear()`` re-reads).

    Raises:
        ValueError: the variable is set to a value that is not a boolean.
    """
    return envs.FD_USE_SKINNY_GEMM()


@functools.lru_cache(maxsize=16)
def skinny_pdl(device: torch.device) -> bool:
    """Whether the skinny GEMM launches on ``device`` (CUDA) are programmatic dependent launches:
    ``FD_SKINNY_GEMM_PDL`` on and :func:`custom_ops.skinny_gemm.pdl_supported` (sm90+). The
    RoPE + KV-write kernel (``RotaryEmbedding.forward_and_store``) asks the same, also with
    ``FD_USE_SKINNY_GEMM=0``. Cached per device; ``cache_clear()`` re-reads.

    Raises:
        ValueError: the variable is set to a value that is not a boolean.
    """
    index = torch.cuda.current_device() if device.index is None else device.index
    return envs.FD_SKINNY_GEMM_PDL() and pdl_supported(index)


def _kernels_allowed(x: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """The skinny GEMM's conditions that do not depend on shapes: no bias, CUDA, not inside
    ``torch.compile``, ``FD_USE_SKINNY_GEMM`` on."""
    return (
        bias is None and x.is_cuda and not torch.compiler.is_compiling() and skinny_gemm_enabled()
    )


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``x @ weight.T (+ bias)``: ``x [..., K]``, ``weight [N, K]``, ``bias [N]`` -> ``[..., N]``,
    all of one dtype and device.

    Without a bias, on CUDA, for a 2-D ``x`` of 1 to 16 rows (see
    :func:`custom_ops.skinny_gemm.use_skinny`: half precision, a contiguous weight, a tiling for
    its shape) and with ``FD_USE_SKINNY_GEMM`` on, the Triton kernel of
    :mod:`custom_ops.skinny_gemm`; otherwise cuBLAS (``F.linear``, or ``torch.mm`` /
    ``torch.addmm`` into ``out``). Inside ``torch.compile`` (graph_opt_level 1 and 2) always
    the torch op, which Inductor lowers its own way.

    Args:
        out: optional ``[T, N]`` tensor (of ``out_dtype``, else the weight's dtype) on the
            weight's device to write the result into; ``x`` must then be 2-D.
        out_dtype: None (the weight's dtype) or ``torch.float32``: the float32 sums are
            returned unrounded (:func:`linear_float32`; the LM head's logits).

    Raises:
        ValueError: ``FD_USE_SKINNY_GEMM`` is malformed, or ``out`` has the wrong shape or
            dtype on the kernel's path (``torch`` raises RuntimeError for it on cuBLAS's).
    """
    if out_dtype is not None and out_dtype != weight.dtype:
        return linear_float32(x, weight, bias, out, out_dtype)
    if _kernels_allowed(x, bias) and use_skinny(x, weight) and (out is None or out.stride(1) == 1):
        return skinny_linear_launch(x, weight, out, pdl=skinny_pdl(x.device))
    if out is None:
        return F.linear(x, weight, bias)
    if bias is None:
        return torch.mm(x, weight.t(), out=out)
    return torch.addmm(bias, x, weight.t(), out=out)


#: Whether this torch has ``torch.mm(..., out_dtype=)`` (half-precision operands, a float32
#: result; the ``aten::mm.dtype`` overload of newer builds); without it the operands are upcast
#: first (slower, the same sums).
_MM_OUT_DTYPE = "dtype" in torch.ops.aten.mm.overloads()


def linear_float32(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` of half-precision ``x [T, K]`` and ``weight [N, K]`` as float32
    ``[T, N]``: products summed in float32 (as every path sums them) and returned without the
    rounding to the weight's dtype.

    Why: an LM head's bf16 output has a resolution of 2^-8 of a logit's magnitude (0.125 at
    logits of 16 to 32). Two tokens whose float32 logits differ by less than that become an
    exact tie, and argmax breaks it towards the lower token id. On the default model the France
    chat's first token has a margin of 0.082 nats for "The" over "L" in HF float32; the fused
    bf16 path's logits rounded it to an exact tie and the chat answered "L'Étoile, la
    Marseillaise, ..." (H200, 2026-12-04). With float32 logits that path's margin is +0.009 to
    +0.045 and it answers "The capital of France is Paris." HF ``transformers`` and vLLM round
    logits to the model dtype; SGLang's ``--enable-fp32-lm-head`` keeps them in float32.

    On CUDA: the skinny GEMM storing its float32 accumulators (1 to 16 rows, where
    :func:`linear` would take it), else cuBLAS's ``torch.mm(..., out_dtype=torch.float32)``;
    elsewhere the operands are upcast first (CPU bf16 is not a fast path).

    Raises:
        ValueError: ``out_dtype`` other than float32, or a wrong ``out`` on the kernel's path.
    """
    if out_dtype != torch.float32:
        raise ValueError(f"out_dtype={out_dtype} is not supported; supported: torch.float32")
    if x.dim() == 2 and _kernels_allowed(x, bias) and use_skinny(x, weight):
        if out is None or out.stride(1) == 1:
            pdl = skinny_pdl(x.device)
            return skinny_linear_launch(x, weight, out, pdl=pdl, out_dtype=out_dtype)
    if x.is_cuda and x.dim() == 2 and bias is None and _MM_OUT_DTYPE:
        if out is None:
            return torch.mm(x, weight.t(), out_dtype=out_dtype)
        return torch.mm(x, weight.t(), out_dtype=out_dtype, out=out)
    flat = x.reshape(-1, x.shape[-1]).float()
    result = F.linear(flat, weight.float(), None if bias is None else bias.float())
    result = result.reshape(*x.shape[:-1], weight.shape[0])
    return result if out is None else out.copy_(result)


def gated_silu_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    act: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """``act(linear(x, weight, bias))`` for a SwiGLU MLP's merged gate/up projection:
    ``x [T, K]``, ``weight [2I, K]`` (gate rows first) -> ``[T, I]``.

    Where :func:`linear` would take the skinny GEMM (no bias, CUDA, 1 to 16 rows, a tiling for
    the weight, ``FD_USE_SKINNY_GEMM`` on, not inside ``torch.compile``), one kernel writes
    ``silu(gate) * up`` from the projection's accumulators
    (:func:`custom_ops.skinny_gemm.skinny_gated_silu_launch`), saving the activation's launch;
    ``act`` must then be SiLU-and-multiply. Otherwise :func:`linear`, then ``act``.

    Raises:
        ValueError: as :func:`linear`.
    """
    if _kernels_allowed(x, bias) and use_gated_silu(x, weight):
        return skinny_gated_silu_launch(x, weight, pdl=skinny_pdl(x.device))
    return act(linear(x, weight, bias))


def copy_weight(param: torch.Tensor, loaded: torch.Tensor, name: str) -> None:
    """Copy ``loaded`` into ``param`` in place (casting dtype and device).

    Raises:
        ValueError: the shapes differ (the message names ``name`` and both shapes).
    """
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(
            f"weight {name}: checkpoint shape {tuple(loaded.shape)} does not match the model's "
            f"{tuple(param.shape)}"
        )
    with torch.no_grad():
        param.copy_(loaded)


class Linear(nn.Module):
    """``y = x @ weight.T + bias``; ``x [..., input_size]`` -> ``[..., output_size]``.

    Args:
        input_size, output_size: matrix sizes (``weight`` is ``[output_size, input_size]``).
        bias: whether the layer has a bias ``[output_size]``.
        dtype: parameter dtype.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(output_size, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``x [T, input_size]`` (any leading dims without ``out``) -> ``[T, output_size]``.

        Args:
            out: optional ``[T, output_size]`` tensor of the weight's dtype and device to write
                the result into (a persistent buffer, e.g. the piecewise segments' QKV buffer,
                so that no copy follows the matmul); ``x`` must then be 2-D.
        """
        return linear(x, self.weight, self.bias, out)

    def _param(self, param_name: str) -> torch.Tensor:
        param = getattr(self, param_name, None)
        if param_name not in ("weight", "bias") or param is None:
            raise KeyError(f"{type(self).__name__} has no parameter {param_name!r}")
        return param

    def load_weight(
        self, param_name: str, loaded: torch.Tensor, shard_id: Hashable | None = None
    ) -> None:
        """Load ``weight`` or ``bias`` from a checkpoint tensor (``shard_id`` must be None)."""
        if shard_id is not None:
            raise KeyError(f"{type(self).__name__} has no shard {shard_id!r}")
        copy_weight(self._param(param_name), loaded, param_name)

    def export_weight(self, param_name: str, shard_id: Hashable | None = None) -> torch.Tensor:
        """The checkpoint tensor of ``weight`` or ``bias`` (a view; ``shard_id`` must be None)."""
        if shard_id is not None:
            raise KeyError(f"{type(self).__name__} has no shard {shard_id!r}")
        return self._param(param_name).detach()

    def extra_repr(self) -> str:
        return f"{self.input_size} -> {self.output_size}, bias={self.bias is not None}"


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output dimension.

    Args:
        input_size: input features.
        output_sizes: output rows of each shard, in order.
        shard_ids: one hashable id per shard (e.g. ``0, 1`` for gate/up).
        bias, dtype: as :class:`Linear`.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        shard_ids: Sequence[Hashable],
        bias: bool = False,
        dtype: torch.dtype | None = None,
    ):
        if len(output_sizes) != len(shard_ids):
            raise ValueError("output_sizes and shard_ids must have the same length")
        super().__init__(input_size, sum(output_sizes), bias=bias, dtype=dtype)
        self.output_sizes = list(output_sizes)
        self.shard_ids = list(shard_ids)
        self._offsets: dict[Hashable, tuple[int, int]] = {}
        start = 0
        for sid, size in zip(shard_ids, output_sizes):
            self._offsets[sid] = (start, size)
            start += size

    def shard_range(self, shard_id: Hashable) -> tuple[int, int]:
        """``(first output row, number of rows)`` of a shard.

        Raises:
            KeyError: unknown ``shard_id`` (the message lists the valid ones).
        """
        if shard_id not in self._offsets:
            raise KeyError(f"unknown shard {shard_id!r}; valid: {self.shard_ids}")
        return self._offsets[shard_id]

    def load_weight(
        self, param_name: str, loaded: torch.Tensor, shard_id: Hashable | None = None
    ) -> None:
        """Load one shard's rows of ``weight`` or ``bias`` (``shard_id`` None: the whole merge)."""
        param = self._param(param_name)
        if shard_id is None:
            copy_weight(param, loaded, param_name)
            return
        start, size = self.shard_range(shard_id)
        copy_weight(param.narrow(0, start, size), loaded, f"{param_name}[shard {shard_id}]")

    def export_weight(self, param_name: str, shard_id: Hashable | None = None) -> torch.Tensor:
        """One shard's rows of ``weight`` or ``bias`` (a view), or the whole merge."""
        param = self._param(param_name).detach()
        if shard_id is None:
            return param
        start, size = self.shard_range(shard_id)
        return param.narrow(0, start, size)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Split an output ``[..., output_size]`` into per-shard views, in shard order."""
        return y.split(self.output_sizes, dim=-1)


class QKVLinear(MergedLinear):
    """Merged query/key/value projection: ``[..., hidden]`` -> ``[..., (H + 2 * KV) * head_dim]``.

    Shards ``"q"`` (``num_heads * head_dim`` rows), ``"k"`` and ``"v"``
    (``num_kv_heads * head_dim`` rows each).
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        dtype: torch.dtype | None = None,
    ):
        self.head_dim = head_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        super().__init__(
            hidden_size, [q_size, kv_size, kv_size], ["q", "k", "v"], bias=bias, dtype=dtype
        )
