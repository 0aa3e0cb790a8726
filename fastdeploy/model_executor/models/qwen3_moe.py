"""Qwen3-MoE (e.g. Qwen3-30B-A3B): the Qwen3 decoder (q/k norm) with sparse layers.

As ``transformers``' ``modeling_qwen3_moe``: a layer is sparse unless it is in ``mlp_only_layers``,
when ``num_experts > 0`` and ``(layer + 1) % decoder_sparse_step == 0``; the router is a softmax
top-k, renormalised when ``norm_topk_prob``; there are no shared experts.
"""

from __future__ import annotations

from typing import Any

import torch

from fastdeploy.model_executor.layers.moe import MoERouting, SparseMoeBlock
from fastdeploy.model_executor.models.llama import DecoderFlags
from fastdeploy.model_executor.models.moe_decoder import MoEDecoderForCausalLM


class Qwen3MoeForCausalLM(MoEDecoderForCausalLM):
    """Qwen3-MoE: q/k norm; q/k/v/o bias only with ``attention_bias``; router in the model dtype."""

    @classmethod
    def decoder_flags(cls, hf_config: Any) -> DecoderFlags:
        bias = bool(getattr(hf_config, "attention_bias", False))
        return DecoderFlags(qkv_bias=bias, o_proj_bias=bias, qk_norm=True)

    def is_moe_layer(self, hf_config: Any, layer_idx: int) -> bool:
        step = getattr(hf_config, "decoder_sparse_step", 1) or 1
        return (
            layer_idx not in (getattr(hf_config, "mlp_only_layers", None) or [])
            and hf_config.num_experts > 0
            and (layer_idx + 1) % step == 0
        )

    def make_moe_block(self, hf_config: Any, dtype: torch.dtype) -> SparseMoeBlock:
        routing = MoERouting(
            top_k=hf_config.num_experts_per_tok,
            scoring="softmax",
            renormalize=bool(hf_config.norm_topk_prob),
        )
        return SparseMoeBlock(
            hf_config.hidden_size,
            hf_config.moe_intermediate_size,
            hf_config.num_experts,
            routing,
            dtype=dtype,
            gate_dtype=dtype,
        )
