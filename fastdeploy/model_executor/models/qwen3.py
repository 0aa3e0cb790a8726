"""Qwen3: the shared decoder with per-head RMSNorm of q and k before RoPE and an explicit
``head_dim`` (``num_heads * head_dim`` may differ from ``hidden_size``)."""

from __future__ import annotations

from typing import Any

from fastdeploy.model_executor.models.llama import DecoderFlags, DecoderForCausalLM


class Qwen3ForCausalLM(DecoderForCausalLM):
    """Qwen3 (dense): q/k norm; q/k/v/o bias only with ``attention_bias``."""

    @classmethod
    def decoder_flags(cls, hf_config: Any) -> DecoderFlags:
        bias = bool(getattr(hf_config, "attention_bias", False))
        return DecoderFlags(qkv_bias=bias, o_proj_bias=bias, qk_norm=True)
