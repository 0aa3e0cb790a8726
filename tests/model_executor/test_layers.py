"""Layers on their own: RoPE, RMSNorm, merged linears, KV write, torch-native attention."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from custom_ops.kv_cache_ops import write_kv_cache_torch as write_kv_cache_reference
from fastdeploy.model_executor.layers.attention.backend import AttentionBatch
from fastdeploy.model_executor.layers.attention.torch_native import TorchNativeAttentionBackend
from fastdeploy.model_executor.layers.linear import QKVLinear
from fastdeploy.model_executor.layers.normalization import RMSNorm
from fastdeploy.model_executor.layers.rotary_embedding import (
    RotaryEmbedding,
    compute_inv_freq,
    rope_parameters_from_config,
)

LLAMA3 = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)


def test_llama3_rope_matches_transformers_and_old_style_config():
    rope = dict(rope_type="llama3", rope_theta=500000.0, original_max_position_embeddings=8192)
    cfg = transformers.LlamaConfig(
        hidden_size=256,
        num_attention_heads=2,
        max_position_embeddings=131072,
        rope_parameters={**rope, **LLAMA3},
    )
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    params = rope_parameters_from_config(cfg)
    assert torch.equal(compute_inv_freq(128, params), ref)
    # transformers < 5: rope_theta at the top, rope_scaling with "type"
    old = SimpleNamespace(
        rope_theta=500000.0,
        rope_scaling={"type": "llama3", **LLAMA3, "original_max_position_embeddings": 8192},
        max_position_embeddings=131072,
    )
    assert torch.equal(compute_inv_freq(128, rope_parameters_from_config(old)), ref)


def test_default_rope_from_old_config_and_unsupported_type():
    old = SimpleNamespace(rope_theta=100000.0, rope_scaling=None, max_position_embeddings=64)
    params = rope_parameters_from_config(old)
    assert params == {"rope_type": "default", "rope_theta": 100000.0}
    expected = 1.0 / 100000.0 ** (torch.arange(0, 64, 2).float() / 64)
    assert torch.allclose(compute_inv_freq(64, params), expected)
    with pytest.raises(ValueError, match="rope_type='yarn' is not supported.*llama3"):
        compute_inv_freq(64, {"rope_type": "yarn", "rope_theta": 1e4})


def test_rotary_embedding_matches_hf_apply_rotary_pos_emb():
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=2, rope_theta=1e4)
    positions = torch.tensor([0, 3, 7, 200])
    q, k = torch.randn(4, 2 * 32), torch.randn(4, 1 * 32)
    rope = RotaryEmbedding(32, 256, rope_parameters_from_config(cfg))
    q_out, k_out = rope(positions, q, k)
    cos, sin = LlamaRotaryEmbedding(cfg)(q, positions[None])
    q_ref, k_ref = apply_rotary_pos_emb(
        q.view(1, 4, 2, 32).transpose(1, 2), k.view(1, 4, 1, 32).transpose(1, 2), cos, sin
    )
    assert torch.equal(q_out, q_ref.transpose(1, 2).reshape(4, 64))
    assert torch.equal(k_out, k_ref.transpose(1, 2).reshape(4, 32))


def test_rmsnorm_fused_residual():
    norm = RMSNorm(8, eps=1e-5)
    x, r = torch.randn(3, 8), torch.randn(3, 8)
    out, new_residual = norm(x, r)
    assert torch.equal(new_residual, x + r)
    assert torch.equal(out, norm(x + r))
    expected = (x + r) / torch.sqrt((x + r).pow(2).mean(-1, keepdim=True) + 1e-5)
    assert torch.allclose(out, expected, atol=1e-6)


def test_qkv_linear_loads_and_exports_shards():
    qkv = QKVLinear(16, head_dim=4, num_heads=4, num_kv_heads=2, bias=True)
    q, k, v = torch.randn(16, 16), torch.randn(8, 16), torch.randn(8, 16)
    for sid, w in zip("qkv", (q, k, v)):
        qkv.load_weight("weight", w, sid)
        qkv.load_weight("bias", torch.arange(w.shape[0]).float(), sid)
    assert torch.equal(qkv.export_weight("weight", "k"), k)
    x = torch.randn(3, 16)
    outs = qkv.split(qkv(x))
    assert torch.allclose(outs[2], x @ v.T + torch.arange(8).float(), atol=1e-6)
    with pytest.raises(KeyError, match="unknown shard 'x'"):
        qkv.load_weight("weight", q, "x")
    with pytest.raises(ValueError, match=r"checkpoint shape \(8, 16\) does not match"):
        qkv.load_weight("weight", k, "q")


def test_write_kv_cache_reference_skips_slot_minus_one():
    kv_cache = torch.full((4, 2, 4, 2, 3), 7.0)  # sentinel everywhere
    k = torch.arange(3 * 6).float().view(3, 6)
    v = -k
    write_kv_cache_reference(k, v, kv_cache, torch.tensor([5, -1, 14, -1]))
    assert torch.equal(kv_cache[1, 0, 1], k[0].view(2, 3))
    assert torch.equal(kv_cache[3, 1, 2], v[2].view(2, 3))
    written = torch.zeros_like(kv_cache, dtype=torch.bool)
    written[1, :, 1] = written[3, :, 2] = True
    assert (kv_cache[~written] == 7.0).all()  # the -1 row went nowhere


def dense_reference(q, k_hist, v_hist, num_heads, num_kv_heads):
    """Causal attention of the last q rows over a dense history, heads repeated by hand."""
    L, S, d = q.shape[0], k_hist.shape[0], q.shape[1] // num_heads
    rep = num_heads // num_kv_heads
    qh = q.view(L, num_heads, d).transpose(0, 1)
    kh = k_hist.view(S, num_kv_heads, d).repeat_interleave(rep, 1).transpose(0, 1)
    vh = v_hist.view(S, num_kv_heads, d).repeat_interleave(rep, 1).transpose(0, 1)
    scores = qh @ kh.transpose(1, 2) / d**0.5
    mask = torch.ones(L, S, dtype=torch.bool).tril(S - L)
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return (probs @ vh).transpose(0, 1).reshape(L, num_heads * d)


def test_torch_native_mixed_batch_matches_dense_attention():
    """Three requests: a decode token after 9 cached, a 4-token chunk after 6 cached, a fresh
    5-token prefill; plus two padding rows. Blocks are scattered."""
    torch.manual_seed(0)
    H, KV, D, bs = 4, 2, 8, 4
    backend = TorchNativeAttentionBackend(H, KV, D, bs, torch.float32, "cpu")
    kv_cache = torch.zeros(backend.kv_cache_shape(12))
    tables = [[7, 2, 9], [4, 11, 0], [5, 3, 0]]
    cached, new = [9, 6, 0], [1, 4, 5]
    hist_k = [torch.randn(c + n, KV * D) for c, n in zip(cached, new)]
    hist_v = [torch.randn(c + n, KV * D) for c, n in zip(cached, new)]
    for t, hk, hv, c in zip(tables, hist_k, hist_v, cached):  # plant the cached tokens
        slots = torch.tensor([t[p // bs] * bs + p % bs for p in range(c)], dtype=torch.int64)
        write_kv_cache_reference(hk[:c], hv[:c], kv_cache, slots)
    slots = [
        t[p // bs] * bs + p % bs for t, c, n in zip(tables, cached, new) for p in range(c, c + n)
    ]
    T = sum(new) + 2
    q = torch.randn(T, H * D)
    k = torch.cat([hk[c:] for hk, c in zip(hist_k, cached)] + [torch.randn(2, KV * D)])
    v = torch.cat([hv[c:] for hv, c in zip(hist_v, cached)] + [torch.randn(2, KV * D)])
    seq_lens = [c + n for c, n in zip(cached, new)]
    batch = AttentionBatch(
        num_reqs=3,
        num_tokens=sum(new),
        query_start_loc=torch.tensor([0, 1, 5, 10], dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        slot_mapping=torch.tensor(slots + [-1, -1]),
        max_query_len=5,
        max_seq_len=max(seq_lens),
        is_decode_only=False,
        query_lens_host=new,
        seq_lens_host=seq_lens,
    )
    out = backend.forward(q, k, v, kv_cache, backend.build_metadata(batch))
    assert out.shape == (T, H * D)
    start = 0
    for i in range(3):
        ref = dense_reference(q[start : start + new[i]], hist_k[i], hist_v[i], H, KV)
        assert torch.allclose(out[start : start + new[i]], ref, atol=1e-5), i
        start += new[i]
    assert (out[-2:] == 0).all()


def test_lm_head_returns_float32_logits_unrounded():
    """A bf16 LM head sums in float32 and returns float32 logits, not rounded to bf16: bf16
    logits near 20 are 0.125 apart, so a smaller margin became an exact tie (the France chat's
    first token on the H200, 2026-12-04)."""
    from fastdeploy.model_executor.layers.embeddings import LMHead

    g = torch.Generator().manual_seed(0)
    head = LMHead(300, 64, torch.bfloat16)
    head.weight.data = (torch.randn(300, 64, generator=g) * 0.5).to(torch.bfloat16)
    hidden = (torch.randn(5, 64, generator=g) * 4).to(torch.bfloat16)
    exact = hidden.double() @ head.weight.double().t()
    logits = head(hidden)
    assert logits.dtype == torch.float32
    assert (logits.double() - exact).abs().max() < 1e-4
    rounded = exact.to(torch.bfloat16).double()
    assert (rounded - exact).abs().max() > 1e-2  # what bf16 logits would have lost
    out = torch.empty(5, 300)
    assert head(hidden, out=out).data_ptr() == out.data_ptr() and torch.equal(out, logits)
