"""GLM-4-MoE (GLM-4.5, GLM-4.5-Air): a decoder with partial RoPE, dense first layers, and sparse
layers with a sigmoid router and shared experts.

As ``transformers``' ``modeling_glm4_moe``:

- attention: q/k/v bias with ``attention_bias``, never on o_proj; per-head q/k RMSNorm with
  ``use_qk_norm``; RoPE (neox style) on the first ``partial_rotary_factor * head_dim`` features of
  each head only;
- layers ``< first_k_dense_replace`` have a dense MLP of ``intermediate_size``, the others are
  sparse: ``n_routed_experts`` experts of ``moe_intermediate_size`` plus one shared MLP of
  ``n_shared_experts * moe_intermediate_size``;
- the router (float32 gate) is DeepSeek-V3's: sigmoid, ``e_score_correction_bias`` for the choice,
  grouped top-k (``n_group``, ``topk_group``), renormalised with ``norm_topk_prob``, scaled by
  ``routed_scaling_factor``;
- multi-token-prediction layers in checkpoints (``model.layers.<num_hidden_layers + i>``) are not
  used and are skipped.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from fastdeploy.model_executor.layers.moe import MoERouting, SparseMoeBlock
from fastdeploy.model_executor.layers.rotary_embedding import (
    RotaryEmbedding,
    rope_parameters_from_config,
)
from fastdeploy.model_executor.models.llama import DecoderFlags, _head_dim
from fastdeploy.model_executor.models.moe_decoder import MoEDecoderForCausalLM

_LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")


def partial_rotary_factor(hf_config: Any) -> float:
    """GLM's ``partial_rotary_factor``: in ``rope_parameters`` (transformers >= 5) or on the
    config, else 0.5 (``Glm4MoeConfig``'s default)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None))
    return 0.5 if factor is None else float(factor)


class Glm4MoeForCausalLM(MoEDecoderForCausalLM):
    """GLM-4-MoE; ``n_routed_experts`` experts (``num_local_experts`` in ``transformers``)."""

    @classmethod
    def decoder_flags(cls, hf_config: Any) -> DecoderFlags:
        return DecoderFlags(
            qkv_bias=bool(getattr(hf_config, "attention_bias", False)),
            qk_norm=bool(getattr(hf_config, "use_qk_norm", False)),
        )

    def make_rotary_embedding(self, hf_config: Any, dtype: torch.dtype) -> nn.Module:
        head_dim = _head_dim(hf_config)
        return RotaryEmbedding(
            head_dim,
            hf_config.max_position_embeddings,
            rope_parameters_from_config(hf_config),
            dtype,
            rotary_dim=int(head_dim * partial_rotary_factor(hf_config)),
        )

    def is_moe_layer(self, hf_config: Any, layer_idx: int) -> bool:
        return layer_idx >= hf_config.first_k_dense_replace

    def make_moe_block(self, hf_config: Any, dtype: torch.dtype) -> SparseMoeBlock:
        routing = MoERouting(
            top_k=hf_config.num_experts_per_tok,
            scoring="sigmoid",
            renormalize=bool(hf_config.norm_topk_prob),
            norm_eps=1e-20,
            num_groups=hf_config.n_group,
            topk_groups=hf_config.topk_group,
            routed_scaling_factor=float(hf_config.routed_scaling_factor),
        )
        inter = hf_config.moe_intermediate_size
        shared = self.make_shared_experts(
            hf_config.hidden_size, inter * hf_config.n_shared_experts, False, dtype
        )
        return SparseMoeBlock(
            hf_config.hidden_size,
            inter,
            hf_config.n_routed_experts,
            routing,
            dtype=dtype,
            gate_dtype=torch.float32,
            correction_bias=True,
            shared_experts=shared,
        )

    def is_ignored_weight(self, hf_name: str) -> bool:
        m = _LAYER_INDEX.match(hf_name)
        if m and int(m.group(1)) >= len(self.layers):  # multi-token prediction layers
            return True
        return super().is_ignored_weight(hf_name)
