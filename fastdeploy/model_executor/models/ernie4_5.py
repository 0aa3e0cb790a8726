"""ERNIE 4.5 (Baidu): the dense ``Ernie4_5ForCausalLM`` (e.g. ERNIE-4.5-0.3B) and the sparse
``Ernie4_5_MoeForCausalLM`` (e.g. ERNIE-4.5-21B-A3B).

As ``transformers``' ``modeling_ernie4_5`` / ``modeling_ernie4_5_moe``:

- RoPE over adjacent pairs (GPT-J layout), computed in float32;
- ``use_bias`` puts a bias on q/k/v/o and the MLPs;
- MoE: layer ``i`` is sparse when ``(i + 1) % moe_layer_interval == 0`` and
  ``moe_layer_start_index <= i <= moe_layer_end_index`` (-1: the last layer); ``moe_num_experts``
  experts of ``moe_intermediate_size``, ``moe_k`` per token, plus shared experts of
  ``moe_num_shared_experts * moe_intermediate_size``; the router (float32 gate) takes a softmax,
  chooses by ``probs + e_score_correction_bias`` and divides the chosen probabilities by
  ``max(sum, moe_norm_min)``;
- the correction bias is ``mlp.moe_statics.e_score_correction_bias`` (``[1, E]``) on disk and
  ``mlp.gate.moe_statics.e_score_correction_bias`` in ``transformers``; both load.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fastdeploy.model_executor.layers.moe import MoERouting, SparseMoeBlock
from fastdeploy.model_executor.layers.rotary_embedding import (
    InterleavedRotaryEmbedding,
    rope_parameters_from_config,
)
from fastdeploy.model_executor.models.llama import DecoderFlags, DecoderForCausalLM, _head_dim
from fastdeploy.model_executor.models.moe_decoder import MoEDecoderForCausalLM


def _ernie_flags(hf_config: Any) -> DecoderFlags:
    bias = bool(getattr(hf_config, "use_bias", False))
    return DecoderFlags(qkv_bias=bias, o_proj_bias=bias, mlp_bias=bias)


def _ernie_rotary(hf_config: Any) -> nn.Module:
    return InterleavedRotaryEmbedding(
        _head_dim(hf_config),
        hf_config.max_position_embeddings,
        rope_parameters_from_config(hf_config),
    )


class Ernie4_5ForCausalLM(DecoderForCausalLM):
    """ERNIE 4.5 dense: interleaved float32 RoPE, ``use_bias`` on attention and MLP."""

    @classmethod
    def decoder_flags(cls, hf_config: Any) -> DecoderFlags:
        return _ernie_flags(hf_config)

    def make_rotary_embedding(self, hf_config: Any, dtype: torch.dtype) -> nn.Module:
        return _ernie_rotary(hf_config)


class Ernie4_5_MoeForCausalLM(MoEDecoderForCausalLM):
    """ERNIE 4.5 MoE.

    Raises:
        ValueError: ``use_bias=True`` (its ``lm_head`` would carry a bias, which we do not
            implement; the published ERNIE-4.5 MoE checkpoints have ``use_bias=false``).
    """

    BIAS_ALIASES = (
        "mlp.moe_statics.e_score_correction_bias",
        "mlp.gate.e_score_correction_bias",
        "mlp.gate.moe_statics.e_score_correction_bias",
    )

    def __init__(self, hf_config: Any, dtype: torch.dtype = torch.float32):
        if getattr(hf_config, "use_bias", False):
            raise ValueError(
                "use_bias=True is not supported for Ernie4_5_MoeForCausalLM (lm_head bias); "
                "supported: use_bias=False"
            )
        super().__init__(hf_config, dtype)

    @classmethod
    def decoder_flags(cls, hf_config: Any) -> DecoderFlags:
        return _ernie_flags(hf_config)

    def make_rotary_embedding(self, hf_config: Any, dtype: torch.dtype) -> nn.Module:
        return _ernie_rotary(hf_config)

    def is_moe_layer(self, hf_config: Any, layer_idx: int) -> bool:
        end = hf_config.moe_layer_end_index
        end = hf_config.num_hidden_layers - 1 if end is None or end < 0 else end
        return (
            (layer_idx + 1) % hf_config.moe_layer_interval == 0
            and hf_config.moe_layer_start_index <= layer_idx <= end
        )

    def make_moe_block(self, hf_config: Any, dtype: torch.dtype) -> SparseMoeBlock:
        routing = MoERouting(
            top_k=hf_config.moe_k,
            scoring="softmax",
            renormalize=True,
            norm_min=float(hf_config.moe_norm_min),
        )
        inter = hf_config.moe_intermediate_size
        shared = self.make_shared_experts(
            hf_config.hidden_size, inter * (hf_config.moe_num_shared_experts or 0), False, dtype
        )
        return SparseMoeBlock(
            hf_config.hidden_size,
            inter,
            hf_config.moe_num_experts,
            routing,
            dtype=dtype,
            gate_dtype=torch.float32,
            correction_bias=True,
            shared_experts=shared,
        )

    def is_ignored_weight(self, hf_name: str) -> bool:
        return "mtp" in hf_name or super().is_ignored_weight(hf_name)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """As the base class; the correction bias in ``transformers``' ``[1, E]`` shape."""
        out = super().hf_state_dict()
        for name, tensor in out.items():
            if name.endswith("e_score_correction_bias"):
                out[name] = tensor.unsqueeze(0)
        return out
