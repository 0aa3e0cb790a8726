"""The torch reference of the fused RoPE + KV write (CPU): it rotates q and k in place exactly as
the unfused RoPE module does, stores the rotated k and the v at their slots, and writes nothing
for a padding row. The Triton kernel is checked against this reference on the GPU
(``tests/gpu/test_fused_ops_gpu.py``)."""

import pytest
import torch

from custom_ops.kv_cache_ops import write_kv_cache_torch
from custom_ops.rope_kv_ops import rope_and_write_kv, rope_and_write_kv_torch
from fastdeploy.model_executor.layers.rotary_embedding import RotaryEmbedding

NUM_BLOCKS, BLOCK_SIZE, HEADS, KV_HEADS, HEAD_DIM = 6, 4, 4, 2, 16
PARAMS = {"rope_type": "default", "rope_theta": 10000.0}


def make_inputs(rotary_dim: int, tokens: int = 5):
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=g)
    q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
    rope = RotaryEmbedding(HEAD_DIM, 64, PARAMS, torch.float32, rotary_dim=rotary_dim)
    positions = torch.tensor([0, 3, 17, 40, 63][:tokens], dtype=torch.int64)
    cache = torch.zeros(NUM_BLOCKS, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    return qkv, q, k, v, rope, positions, cache


@pytest.mark.parametrize("rotary_dim", [HEAD_DIM, HEAD_DIM // 2])
def test_reference_equals_rope_then_kv_write(rotary_dim: int):
    qkv, q, k, v, rope, positions, cache = make_inputs(rotary_dim)
    slots = torch.tensor([5, 6, -1, 8, 21], dtype=torch.int64)
    want_q, want_k = rope.forward_native(positions, q.clone(), k.clone())
    want_cache = cache.clone()
    write_kv_cache_torch(want_k, v, want_cache, slots)
    v_before = v.clone()

    out_q, out_k = rope_and_write_kv_torch(
        positions, q, k, v, HEAD_DIM, rope.cos_sin_cache, cache, slots
    )
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()  # in place
    torch.testing.assert_close(q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, want_k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache, want_cache, rtol=1e-5, atol=1e-5)
    assert torch.equal(v, v_before)
    # The padding row (token 2) was rotated but stored nowhere.
    assert not torch.isclose(cache, k[2].view(KV_HEADS, HEAD_DIM)).all(-1).all(-1).any()
    # The partial rotary leaves the tail of every head untouched.
    if rotary_dim < HEAD_DIM:
        tail = qkv.view(5, -1, HEAD_DIM)[..., rotary_dim:]
        assert torch.equal(tail, make_inputs(rotary_dim)[0].view(5, -1, HEAD_DIM)[..., rotary_dim:])


def test_dispatcher_uses_reference_on_cpu():
    _, q, k, v, rope, positions, cache = make_inputs(HEAD_DIM)
    _, q2, k2, v2, _, _, cache2 = make_inputs(HEAD_DIM)
    slots = torch.tensor([0, 1, 2, 3, 4], dtype=torch.int64)
    rope_and_write_kv(positions, q, k, v, HEAD_DIM, rope.cos_sin_cache, cache, slots)
    rope_and_write_kv_torch(positions, q2, k2, v2, HEAD_DIM, rope.cos_sin_cache, cache2, slots)
    assert torch.equal(cache, cache2) and torch.equal(q, q2)


@pytest.mark.parametrize(
    "change, message",
    [
        ("k", "k must be"),
        ("positions", "positions must be"),
        ("slots", "slot_mapping must be"),
        ("cos_sin", "cos_sin_cache must be"),
        ("cache", "kv_cache must be"),
    ],
)
def test_bad_shapes_name_the_argument(change: str, message: str):
    _, q, k, v, rope, positions, cache = make_inputs(HEAD_DIM)
    slots = torch.arange(5, dtype=torch.int64)
    cos_sin = rope.cos_sin_cache
    if change == "k":
        k = k[:, :-1]
    elif change == "positions":
        positions = positions[:3]
    elif change == "slots":
        slots = slots[:2]
    elif change == "cos_sin":
        cos_sin = cos_sin[:, :3]
    else:
        cache = cache[..., :8]
    with pytest.raises(ValueError, match=message):
        rope_and_write_kv_torch(positions, q, k, v, HEAD_DIM, cos_sin, cache, slots)
