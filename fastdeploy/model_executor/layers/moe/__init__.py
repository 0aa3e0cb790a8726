"""Mixture-of-experts layers: routing, the fused MoE op, and the sparse block of a decoder layer."""

from fastdeploy.model_executor.layers.moe.fused_moe import (
    BACKENDS,
    default_backend,
    fused_experts,
    fused_moe,
    fused_moe_reference,
    grouped_mm_available,
)
from fastdeploy.model_executor.layers.moe.layer import FusedMoEExperts, MoEGate, SparseMoeBlock
from fastdeploy.model_executor.layers.moe.routing import MoERouting, select_experts

__all__ = [
    "BACKENDS",
    "FusedMoEExperts",
    "MoEGate",
    "MoERouting",
    "SparseMoeBlock",
    "default_backend",
    "fused_experts",
    "fused_moe",
    "fused_moe_reference",
    "grouped_mm_available",
    "select_experts",
]
