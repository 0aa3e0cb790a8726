"""Qwen2 / Qwen2.5: the shared decoder with a bias on q/k/v (not on o_proj or the MLP)."""

from __future__ import annotations

from typing import Any

from fastdeploy.model_executor.models.llama import DecoderFlags, DecoderForCausalLM


class Qwen2ForCausalLM(DecoderForCausalLM):
    """Qwen2: q/k/v bias always on; a sliding window is not supported (a warning says so)."""

    @classmethod
    def decoder_flags(cls, hf_config: Any) -> DecoderFlags:
        return DecoderFlags(qkv_bias=True)
