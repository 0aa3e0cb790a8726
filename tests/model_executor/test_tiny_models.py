"""Tiny random Llama / Qwen2 / Qwen3 models: ours, given a transformers model's state dict, must
give its logits and its greedy tokens.

Weights are drawn wider than the usual 0.02 init (and norms away from 1) so the logits are spread
out and every weight matters. Measured max abs logit difference on CPU float32 (logits up to ~7):
0.0 for all four.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from paged_runner import PagedRunner

from fastdeploy.model_executor.models.registry import resolve_model_class

LOGITS_ATOL = 1e-5
COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)
LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=10000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=64,
)


def config(name: str):
    if name == "qwen3":
        return transformers.Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=False)
    if name == "qwen2":
        return transformers.Qwen2Config(**COMMON, tie_word_embeddings=True)
    if name == "llama3_bias":  # llama3 RoPE scaling, biases on attention and MLP
        return transformers.LlamaConfig(
            **COMMON, attention_bias=True, mlp_bias=True, rope_parameters=LLAMA3_ROPE
        )
    if name == "mistral":
        return transformers.MistralConfig(**COMMON, sliding_window=None)
    raise KeyError(name)


def randomize(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_(1 + 0.2 * noise)
            else:
                p.copy_(noise * (0.1 if p.ndim == 1 else 0.15))


def build_pair(name: str, dtype=torch.float32):
    cfg = config(name)
    cfg.architectures = [type(cfg).__name__.replace("Config", "ForCausalLM")]
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    randomize(hf, seed=1)
    ours = resolve_model_class(cfg)(cfg, dtype)
    ours.load_weights(hf.state_dict().items())
    return hf, ours.eval()


@pytest.mark.parametrize("name", ["qwen3", "qwen2", "llama3_bias", "mistral"])
def test_prefill_logits_and_greedy_tokens_match_hf(name):
    hf, ours = build_pair(name)
    prompt = torch.randint(0, 256, (100,), generator=torch.Generator().manual_seed(2)).tolist()
    _, logits = PagedRunner(ours, block_size=8).step([("r", prompt)])
    with torch.inference_mode():
        ref = hf(torch.tensor([prompt])).logits[0]
        gen = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=24,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
    assert (logits - ref).abs().max().item() < LOGITS_ATOL
    tokens, _ = PagedRunner(ours, block_size=8).generate_greedy("r", prompt, 24, set())
    assert tokens == gen


def test_qwen3_shapes_and_pieces():
    """Qwen3 with ``head_dim * heads != hidden``: q/k norm present, per-layer pieces shape-check."""
    _, ours = build_pair("qwen3")
    layer = ours.layers[0]
    assert layer.q_norm is not None and layer.qkv_proj.weight.shape == ((4 + 2 * 2) * 32, 64)
    positions = torch.arange(5)
    q, k, v, residual = layer.pre_attention(positions, ours.embed(torch.arange(5)), None)
    assert q.shape == (5, 128) and k.shape == v.shape == (5, 64) and residual.shape == (5, 64)
    hidden, residual = layer.post_attention(torch.zeros(5, 128), residual)
    assert hidden.shape == residual.shape == (5, 64)
    assert ours.compute_logits(ours.final_norm(hidden, residual)).dtype == torch.float32


def test_bfloat16_model_runs_and_stays_close():
    hf, ours32 = build_pair("qwen3")
    _, ours16 = build_pair("qwen3", dtype=torch.bfloat16)
    prompt = list(range(1, 40))
    ref, _ = PagedRunner(ours32).step([("r", prompt)])
    got, _ = PagedRunner(ours16).step([("r", prompt)])
    assert got.dtype == torch.float32
    assert torch.allclose(got, ref, atol=0.5, rtol=0.05)


def test_tied_embeddings_share_the_weight_and_skip_lm_head():
    hf, ours = build_pair("qwen2")
    assert ours.lm_head.weight is ours.embed_tokens.weight
    assert "lm_head.weight" not in ours.hf_weight_names()


def test_load_weights_rejects_unknown_missing_and_misshaped():
    hf, ours = build_pair("qwen3")
    state = hf.state_dict()
    with pytest.raises(ValueError, match="unexpected checkpoint weight 'model.layers.9"):
        ours.load_weights([("model.layers.9.mlp.up_proj.weight", state["lm_head.weight"])])
    partial = {k: v for k, v in state.items() if "layers.1.mlp.down_proj" not in k}
    with pytest.raises(ValueError, match="missing 1 weight.*layers.1.mlp.down_proj"):
        ours.load_weights(partial.items())
    with pytest.raises(ValueError, match="does not match"):
        ours.load_weights([("model.norm.weight", torch.ones(3))])
    # rotary inv_freq buffers of old checkpoints are ignored
    ours.load_weights([("model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(3))], False)


def test_hf_state_dict_round_trips():
    hf, ours = build_pair("llama3_bias")
    exported = ours.hf_state_dict()
    for name, tensor in hf.state_dict().items():
        assert torch.equal(exported[name], tensor), name
