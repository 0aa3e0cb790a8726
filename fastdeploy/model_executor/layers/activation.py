"""Gated activations for MLPs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fastdeploy.model_executor.layers.fused_ops import use_flashinfer


class SiluAndMul(nn.Module):
    """SwiGLU gate (Shazeer, 2020, "GLU Variants Improve Transformer"): ``silu(gate) * up``.

    Input ``[..., 2 * d]`` is the output of a merged gate/up projection, gate first;
    output ``[..., d]``, same dtype. On CUDA with the fused ops on
    (:mod:`~fastdeploy.model_executor.layers.fused_ops`) it is one kernel,
    ``flashinfer.activation.silu_and_mul`` (rows of a multiple of 16 bytes); elsewhere the torch
    reference, :meth:`forward_native`.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_flashinfer(x) and x.shape[-1] * x.element_size() % 16 == 0 and x.is_contiguous():
            import flashinfer.activation

            return flashinfer.activation.silu_and_mul(x)
        return self.forward_native(x)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        """The torch reference: ``silu(x[..., :d]) * x[..., d:]``."""
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]
