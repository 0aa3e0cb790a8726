"""The tiny Llama config the CPU tests build engines from (random ``dummy`` weights).

Two layers of width 64, 4 query and 2 KV heads, a 512-token vocabulary and context: fast enough
to start an engine per test on a laptop CPU, yet a real GQA decoder. Tests pass overrides for
what they need (more layers, an untied head).
"""

from __future__ import annotations

from typing import Any

TINY_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True,
    "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip


def tiny_llama(**overrides: Any) -> dict[str, Any]:
    """A copy of :data:`TINY_LLAMA` with ``overrides`` applied (config.json fields)."""
    return {**TINY_LLAMA, **overrides}
