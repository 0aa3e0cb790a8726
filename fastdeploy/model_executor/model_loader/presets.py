"""Model shapes for benchmarks and GPU tests with dummy weights (no download needed).

``write_preset(name, directory)`` writes a Hugging Face ``config.json`` of that shape; load it with
``load_format="dummy"``. Shapes are the published configs of the named models; the ``tiny-*``
presets are small models of each mixture-of-experts family for CPU tests (every routing feature
of the family switched on).
"""

from __future__ import annotations

import json
from pathlib import Path

PRESETS: dict[str, dict] = {
    # HuggingFaceTB/SmolLM2-135M-Instruct
    "smollm2-135m": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    },
    # meta-llama/Meta-Llama-3-8B
    "llama3-8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "torch_dtype": "bfloat16",
    },
    # Qwen/Qwen3-0.6B
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "torch_dtype": "bfloat16",
    },
}


PRESETS.update(
    {
        # Qwen/Qwen3-30B-A3B
        "qwen3-30b-a3b": {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "moe_intermediate_size": 768,
            "num_hidden_layers": 48,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "attention_bias": False,
            "vocab_size": 151936,
            "max_position_embeddings": 40960,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "use_sliding_window": False,
            "tie_word_embeddings": False,
            "bos_token_id": 151643,
            "eos_token_id": 151645,
            "torch_dtype": "bfloat16",
        },
        # baidu/ERNIE-4.5-21B-A3B-PT
        "ernie-4.5-21b-a3b": {
            "architectures": ["Ernie4_5_MoeForCausalLM"],
            "model_type": "ernie4_5_moe",
            "hidden_size": 2560,
            "intermediate_size": 12288,
            "moe_intermediate_size": 1536,
            "num_hidden_layers": 28,
            "num_attention_heads": 20,
            "num_key_value_heads": 4,
            "moe_num_experts": 64,
            "moe_k": 6,
            "moe_num_shared_experts": 2,
            "moe_layer_start_index": 1,
            "moe_layer_end_index": 27,
            "moe_layer_interval": 1,
            "moe_norm_min": 1e-12,
            "use_bias": False,
            "vocab_size": 103424,
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
            "tie_word_embeddings": True,
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "torch_dtype": "bfloat16",
        },
        # baidu/ERNIE-4.5-0.3B-PT
        "ernie-4.5-0.3b": {
            "architectures": ["Ernie4_5ForCausalLM"],
            "model_type": "ernie4_5",
            "hidden_size": 1024,
            "intermediate_size": 3072,
            "num_hidden_layers": 18,
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "head_dim": 128,
            "use_bias": False,
            "vocab_size": 103424,
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
            "tie_word_embeddings": True,
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "torch_dtype": "bfloat16",
        },
        # zai-org/GLM-4.5-Air (its multi-token-prediction layer is not used)
        "glm-4.5-air": {
            "architectures": ["Glm4MoeForCausalLM"],
            "model_type": "glm4_moe",
            "hidden_size": 4096,
            "intermediate_size": 10944,
            "moe_intermediate_size": 1408,
            "num_hidden_layers": 46,
            "num_attention_heads": 96,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "partial_rotary_factor": 0.5,
            "attention_bias": True,
            "use_qk_norm": False,
            "n_routed_experts": 128,
            "n_shared_experts": 1,
            "num_experts_per_tok": 8,
            "n_group": 1,
            "topk_group": 1,
            "routed_scaling_factor": 1.0,
            "norm_topk_prob": True,
            "first_k_dense_replace": 1,
            "num_nextn_predict_layers": 1,
            "vocab_size": 151552,
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-5,
            "rope_theta": 1000000.0,
            "tie_word_embeddings": False,
            "pad_token_id": 151329,
            "eos_token_id": [151329, 151336, 151338],
            "torch_dtype": "bfloat16",
        },
    }
)

_TINY = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
PRESETS.update(
    {
        # 3 layers, layer 1 dense (mlp_only_layers); 8 experts, top-2, renormalised.
        "tiny-qwen3-moe": _TINY
        | {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "num_hidden_layers": 3,
            "head_dim": 32,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [1],
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
        },
        # 3 layers, layer 0 dense; 8 experts in 2 groups (1 chosen), top-2, scaled, one shared
        # expert, partial RoPE, q/k/v bias, q/k norm.
        "tiny-glm4-moe": _TINY
        | {
            "architectures": ["Glm4MoeForCausalLM"],
            "model_type": "glm4_moe",
            "num_hidden_layers": 3,
            "head_dim": 32,
            "partial_rotary_factor": 0.5,
            "attention_bias": True,
            "use_qk_norm": True,
            "n_routed_experts": 8,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "n_group": 2,
            "topk_group": 1,
            "routed_scaling_factor": 2.5,
            "norm_topk_prob": True,
            "first_k_dense_replace": 1,
            "moe_intermediate_size": 32,
            "num_nextn_predict_layers": 0,
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
        },
        # 2 layers with biases everywhere, tied embeddings.
        "tiny-ernie4.5": _TINY
        | {
            "architectures": ["Ernie4_5ForCausalLM"],
            "model_type": "ernie4_5",
            "num_hidden_layers": 2,
            "head_dim": 16,
            "use_bias": True,
            "rope_theta": 10000.0,
            "tie_word_embeddings": True,
        },
        # 4 layers: 0 dense, 1-2 sparse (start 1, end 2), 3 dense; 8 experts, top-2, two shared.
        "tiny-ernie4.5-moe": _TINY
        | {
            "architectures": ["Ernie4_5_MoeForCausalLM"],
            "model_type": "ernie4_5_moe",
            "num_hidden_layers": 4,
            "moe_num_experts": 8,
            "moe_k": 2,
            "moe_intermediate_size": 32,
            "moe_num_shared_experts": 2,
            "moe_layer_start_index": 1,
            "moe_layer_end_index": 2,
            "moe_layer_interval": 1,
            "moe_norm_min": 1e-12,
            "use_bias": False,
            "rope_theta": 10000.0,
            "tie_word_embeddings": True,
        },
    }
)


def write_preset(name: str, directory: str | Path) -> str:
    """Write ``config.json`` of preset ``name`` into ``directory``; returns the directory.

    Raises:
        ValueError: unknown preset (the message lists the valid names).
    """
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; valid: {', '.join(PRESETS)}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(PRESETS[name], indent=1))
    return str(directory)
