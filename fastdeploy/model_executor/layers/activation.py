"""Gated activations for MLPs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """SwiGLU gate (Shazeer, 2020, "GLU Variants Improve Transformer"): ``silu(gate) * up``.

    Input ``[..., 2 * d]`` is the output of a merged gate/up projection, gate first;
    output ``[..., d]``, same dtype.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]
