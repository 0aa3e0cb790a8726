"""Mixture-of-experts modules: the router gate, the stacked expert weights, and the sparse block
(gate -> fused experts -> + shared experts) that replaces a decoder layer's MLP.

Expert weights are stored as ``transformers`` >= 5 keeps them: ``gate_up_proj [E, 2I, H]`` (gate
rows first) and ``down_proj [E, H, I]``. Checkpoints on disk usually hold one matrix per expert
(``experts.<j>.gate_proj.weight``) and GGUF files one stacked matrix per projection
(``ffn_gate_exps``); :meth:`FusedMoEExperts.load_weight` takes all three forms through its shard
ids.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
import torch.nn.functional as F
from torch import nn

from fastdeploy.model_executor.layers.linear import copy_weight
from fastdeploy.model_executor.layers.moe.fused_moe import BACKENDS, default_backend, fused_moe
from fastdeploy.model_executor.layers.moe.routing import MoERouting


class MoEGate(nn.Module):
    """The router's linear layer: ``[T, H]`` -> logits ``[T, E]`` in the gate's dtype.

    GLM-4-MoE and ERNIE-4.5-MoE keep the gate (and the correction bias) in float32 even in a
    bf16 model (``_keep_in_fp32_modules_strict`` in ``transformers``); pass ``dtype=float32``
    for them.

    Args:
        hidden_size, num_experts: the weight is ``[num_experts, hidden_size]``.
        dtype: the weight's dtype; the input is cast to it.
        correction_bias: whether the router has an ``e_score_correction_bias`` (float32 ``[E]``).
    """

    def __init__(
        self, hidden_size: int, num_experts: int, dtype: torch.dtype, correction_bias: bool
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype))
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(num_experts, dtype=torch.float32), requires_grad=False)
            if correction_bias
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight)

    def load_weight(
        self, param_name: str, loaded: torch.Tensor, shard_id: Hashable | None = None
    ) -> None:
        """``weight``, or ``e_score_correction_bias`` of any shape with ``E`` elements (ERNIE
        stores it ``[1, E]``)."""
        param = getattr(self, param_name, None)
        if param is None or shard_id is not None:
            raise KeyError(f"MoEGate has no parameter {param_name!r} / shard {shard_id!r}")
        if param_name == "e_score_correction_bias" and loaded.numel() == param.numel():
            loaded = loaded.reshape(param.shape)
        copy_weight(param, loaded, param_name)

    def export_weight(self, param_name: str, shard_id: Hashable | None = None) -> torch.Tensor:
        return getattr(self, param_name).detach()


class FusedMoEExperts(nn.Module):
    """The experts' weights, stacked.

    Args:
        num_experts: ``E``.
        hidden_size: ``H``.
        intermediate_size: ``I`` (``moe_intermediate_size``).
        dtype: parameter dtype.

    Shard ids of :meth:`load_weight` / :meth:`export_weight`: None (the whole stacked tensor),
    ``("gate", j)`` / ``("up", j)`` (expert ``j``'s rows of ``gate_up_proj``), ``("down", j)``
    (expert ``j`` of ``down_proj``), and ``("gate", None)`` / ``("up", None)`` (those rows of
    every expert).
    """

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size, dtype=dtype)
        )
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, hidden_size, intermediate_size, dtype=dtype)
        )

    def _view(self, param_name: str, shard_id: Hashable | None) -> torch.Tensor:
        if param_name not in ("gate_up_proj", "down_proj"):
            raise KeyError(f"FusedMoEExperts has no parameter {param_name!r}")
        param = getattr(self, param_name)
        if shard_id is None:
            return param
        part, expert = shard_id
        if expert is not None and not 0 <= expert < self.num_experts:
            raise KeyError(f"expert {expert} out of range (num_experts={self.num_experts})")
        view = param if expert is None else param[expert]
        inter = self.intermediate_size
        if param_name == "gate_up_proj" and part in ("gate", "up"):
            start = 0 if part == "gate" else inter
            return view.narrow(-2, start, inter)
        if param_name == "down_proj" and part == "down":
            return view
        raise KeyError(f"no shard {shard_id!r} of {param_name}")

    def load_weight(
        self, param_name: str, loaded: torch.Tensor, shard_id: Hashable | None = None
    ) -> None:
        """Copy a checkpoint tensor into the shard it names (see the class docstring).

        Raises:
            KeyError: unknown parameter, shard or expert.
            ValueError: shape mismatch.
        """
        with torch.no_grad():
            copy_weight(self._view(param_name, shard_id), loaded, f"{param_name}[{shard_id}]")

    def export_weight(self, param_name: str, shard_id: Hashable | None = None) -> torch.Tensor:
        """A view of one shard (or the whole stacked tensor)."""
        return self._view(param_name, shard_id).detach()


class SparseMoeBlock(nn.Module):
    """A decoder layer's feed-forward as a mixture of experts: ``[T, H]`` -> ``[T, H]``.

    ``out = fused_moe(x, gate(x)) + shared_experts(x)``; the routed and shared parts read the same
    normalised input, as in ``transformers``' Glm4MoeMoE and Ernie4_5_MoeSparseMoeBlock.

    Args:
        hidden_size, intermediate_size, num_experts: expert shapes.
        routing: the router's rules (checked against ``num_experts``).
        dtype: the experts' dtype.
        gate_dtype: the router gate's dtype (float32 for GLM and ERNIE).
        correction_bias: whether the gate has ``e_score_correction_bias``.
        shared_experts: an MLP every token goes through (already built), or None.
        backend: force a fused-MoE backend (``grouped_mm`` or ``padded_bmm``); None picks per
            device and dtype (see :func:`~fastdeploy.model_executor.layers.moe.fused_moe.
            default_backend`).

    Raises:
        ValueError: a routing that does not fit ``num_experts``, or an unknown backend.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        routing: MoERouting,
        dtype: torch.dtype,
        gate_dtype: torch.dtype,
        correction_bias: bool = False,
        shared_experts: nn.Module | None = None,
        backend: str | None = None,
    ) -> None:
        super().__init__()
        routing.check(num_experts)
        if backend is not None and backend not in BACKENDS:
            raise ValueError(f"MoE backend {backend!r} is unknown; valid: {BACKENDS}")
        self.routing = routing
        self.backend = backend
        self.gate = MoEGate(hidden_size, num_experts, gate_dtype, correction_bias)
        self.experts = FusedMoEExperts(num_experts, hidden_size, intermediate_size, dtype)
        self.shared_experts = shared_experts

    def resolved_backend(self) -> str:
        """The backend this block's forward uses (decided from the weights' device and dtype)."""
        if self.backend is None:
            self.backend = default_backend(self.experts.gate_up_proj, self.experts.down_proj)
        return self.backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = fused_moe(
            x,
            self.gate(x),
            self.experts.gate_up_proj,
            self.experts.down_proj,
            self.routing,
            self.gate.e_score_correction_bias,
            self.resolved_backend(),
        )
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def extra_repr(self) -> str:
        return f"{self.routing}, backend={self.backend}"
