"""RMS normalisation (Zhang & Sennrich, 2019, "Root Mean Square Layer Normalization")."""

from __future__ import annotations

import torch
from torch import nn

from fastdeploy.model_executor.layers.fused_ops import use_flashinfer


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x**2) + eps)``, in float32 like Hugging Face's LlamaRMSNorm.

    With ``residual`` given, the residual add is fused in front of the norm (as vLLM's
    ``fused_add_rms_norm``): ``x = x + residual`` becomes the new residual and is normalised.

    On CUDA with the fused ops on (:mod:`~fastdeploy.model_executor.layers.fused_ops`) a
    contiguous 2-D input runs as one flashinfer kernel: ``flashinfer.norm.rmsnorm``, or with a
    residual ``flashinfer.norm.fused_add_rmsnorm``, which works **in place**: ``x`` and
    ``residual`` are overwritten with the two outputs (callers pass tensors they no longer
    need). flashinfer multiplies by the weight in float32 before the cast, one rounding fewer
    than the reference; elsewhere the torch reference below runs.

    Args:
        hidden_size: size of the last dimension.
        eps: added to the mean square.
        dtype: parameter dtype (the input's dtype is kept in the output).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None):
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(input_dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalise ``x`` (``[..., hidden_size]``, any float dtype).

        Returns:
            ``norm(x)`` when ``residual`` is None, else ``(norm(x + residual), x + residual)``;
            all of ``x``'s shape and dtype (the flashinfer path returns ``(x, residual)``,
            overwritten).
        """
        if use_flashinfer(x) and x.dim() == 2 and x.is_contiguous():
            import flashinfer.norm

            if residual is None:
                return flashinfer.norm.rmsnorm(x, self.weight, self.eps)
            if residual.is_contiguous() and residual.dtype == x.dtype:
                flashinfer.norm.fused_add_rmsnorm(x, residual, self.weight, self.eps)
                return x, residual
        return self.forward_native(x, residual)

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The torch reference of :meth:`forward` (never in place); the CPU path."""
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"
