"""The torch reference of the KV write (CPU): tokens land at their slots, slot -1 writes nothing."""

import pytest
import torch

from custom_ops.kv_cache_ops import write_kv_cache, write_kv_cache_torch

NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 6, 4, 2, 8
SENTINEL = 12345.0


def make_cache() -> torch.Tensor:
    return torch.zeros(NUM_BLOCKS, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM)


def test_reference_writes_each_token_at_its_slot():
    cache = make_cache()
    slots = torch.tensor([5, 6, 7, 8, 21], dtype=torch.int64)  # crosses blocks 1 -> 2, then 5
    k = torch.randn(5, KV_HEADS * HEAD_DIM)
    v = torch.randn(5, KV_HEADS * HEAD_DIM)
    write_kv_cache_torch(k, v, cache, slots)
    for t, s in enumerate(slots.tolist()):
        block, offset = divmod(s, BLOCK_SIZE)
        assert torch.equal(cache[block, 0, offset], k[t].view(KV_HEADS, HEAD_DIM))
        assert torch.equal(cache[block, 1, offset], v[t].view(KV_HEADS, HEAD_DIM))
    written = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, dtype=torch.bool)
    for s in slots.tolist():
        written[divmod(s, BLOCK_SIZE)] = True
    by_slot = cache.permute(0, 2, 1, 3, 4)  # [num_blocks, block_size, 2, heads, dim]
    assert (by_slot[~written] == 0).all()  # nothing else touched


def test_padding_rows_write_nothing_and_sentinel_survives():
    cache = make_cache()
    cache[3] = SENTINEL  # a block no slot targets
    slots = torch.tensor([0, 1, -1, -1], dtype=torch.int64)
    k = torch.full((4, KV_HEADS, HEAD_DIM), 1.0)  # 3-D form
    v = torch.full((4, KV_HEADS, HEAD_DIM), 2.0)
    k[2:] = -7.0  # padding rows carry a value that must appear nowhere
    v[2:] = -7.0
    write_kv_cache_torch(k, v, cache, slots)
    assert (cache[3] == SENTINEL).all()
    assert not (cache == -7.0).any()
    assert (cache[0, 0, :2] == 1.0).all() and (cache[0, 1, :2] == 2.0).all()


def test_only_first_t_slots_are_read():
    """A slot mapping longer than the step (the runner's padded buffer) is fine."""
    cache = make_cache()
    slots = torch.tensor([2, 9, 13], dtype=torch.int64)
    k = torch.ones(1, KV_HEADS * HEAD_DIM)
    write_kv_cache_torch(k, k * 2, cache, slots)
    assert (cache[0, 0, 2] == 1.0).all()
    assert (cache[2] == 0).all() and (cache[3] == 0).all()


def test_dispatcher_uses_reference_on_cpu():
    cache_a, cache_b = make_cache(), make_cache()
    slots = torch.tensor([3, -1, 17], dtype=torch.int64)
    k, v = torch.randn(3, KV_HEADS * HEAD_DIM), torch.randn(3, KV_HEADS * HEAD_DIM)
    write_kv_cache(k, v, cache_a, slots)
    write_kv_cache_torch(k, v, cache_b, slots)
    assert torch.equal(cache_a, cache_b)


def test_shape_errors():
    cache = make_cache()
    slots = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="kv_cache"):
        write_kv_cache_torch(torch.zeros(2, 16), torch.zeros(2, 16), cache[0], slots)
    with pytest.raises(ValueError, match="k must be"):
        write_kv_cache_torch(torch.zeros(2, 15), torch.zeros(2, 16), cache, slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv_cache_torch(torch.zeros(3, 16), torch.zeros(3, 16), cache, slots)
