"""KVCacheManager: block tables, prefix hits, the never-fully-cached rule, LRU eviction."""

import pytest

from fastdeploy.cache_manager.kv_cache_manager import KVCacheManager
from fastdeploy.core.request import Request
from fastdeploy.core.sampling_params import SamplingParams

BS = 4


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=8))


def compute(kv: KVCacheManager, r: Request, n: int) -> None:
    """Play one step for ``r``: allocate ``n`` tokens, 'run' them, register full blocks."""
    assert kv.allocate_slots(r, n)
    r.num_computed_tokens += n
    kv.cache_full_blocks(r, r.num_computed_tokens)


def test_allocate_slots_covers_tokens():
    kv = KVCacheManager(num_blocks=9, block_size=BS, enable_prefix_caching=False)
    r = req("a", range(10))
    assert kv.allocate_slots(r, 10)
    assert r.block_ids == [1, 2, 3]
    r.num_computed_tokens = 10
    assert kv.allocate_slots(r, 2)  # 12 tokens still fit 3 blocks
    assert r.block_ids == [1, 2, 3]
    assert kv.allocate_slots(r, 3)
    assert r.block_ids == [1, 2, 3, 4]
    assert kv.num_free_blocks == 4
    assert kv.usage == pytest.approx(0.5)
    kv.check_integrity([r.block_ids])
    with pytest.raises(ValueError):
        kv.allocate_slots(r, -1)


def test_allocate_slots_short_changes_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=BS, enable_prefix_caching=False)
    a, b = req("a", range(8)), req("b", range(8))
    assert kv.allocate_slots(a, 8)
    assert not kv.allocate_slots(b, 5)  # needs 2 blocks, 1 free
    assert b.block_ids == []
    assert kv.num_free_blocks == 1
    kv.free(a)
    assert a.block_ids == []
    assert kv.num_free_blocks == 3
    kv.check_integrity([])


def test_prefix_hit_shares_blocks():
    kv = KVCacheManager(num_blocks=17, block_size=BS)
    a = req("a", range(10))
    assert kv.get_computed_blocks(a) == 0
    compute(kv, a, 10)  # 2 full blocks cached, 1 partial
    b = req("b", list(range(8)) + [100, 101, 102])
    assert kv.get_computed_blocks(b) == 8
    assert b.num_cached_tokens == 8 and b.num_computed_tokens == 8
    assert b.block_ids == a.block_ids[:2]
    for block_id in a.block_ids[:2]:
        assert kv.block_pool.ref_count(block_id) == 3  # a, b and the prefix cache
    assert kv.block_pool.ref_count(a.block_ids[2]) == 1  # partial block: private, uncached
    compute(kv, b, 3)
    assert len(b.block_ids) == 3 and b.block_ids[2] not in a.block_ids
    kv.check_integrity([a.block_ids, b.block_ids])
    kv.free(a)
    kv.free(b)
    # The two shared full blocks stay cached (evictable) and count as free.
    assert kv.block_pool.num_used == 2
    assert kv.num_free_blocks == kv.num_usable_blocks
    assert kv.usage == 0.0
    kv.check_integrity([])


def test_prefix_mismatch_in_first_block_is_a_miss():
    kv = KVCacheManager(num_blocks=17, block_size=BS)
    a = req("a", range(9))
    kv.get_computed_blocks(a)
    compute(kv, a, 9)
    b = req("b", [99] + list(range(1, 9)))
    assert kv.get_computed_blocks(b) == 0
    assert b.block_ids == []


@pytest.mark.parametrize(
    ("num_tokens", "expected"),
    [(8, 4), (9, 8), (5, 4), (4, 0), (1, 0), (12, 8)],
)
def test_never_fully_cached(num_tokens, expected):
    """The cached count is block-aligned and strictly below the request's length."""
    kv = KVCacheManager(num_blocks=17, block_size=BS)
    a = req("a", range(16))
    kv.get_computed_blocks(a)
    compute(kv, a, 16)  # 4 full blocks cached
    b = req("b", range(num_tokens))
    assert kv.get_computed_blocks(b) == expected
    assert len(b.block_ids) == expected // BS
    assert b.num_computed_tokens < b.num_tokens


def test_lookup_needs_a_fresh_request():
    kv = KVCacheManager(num_blocks=9, block_size=BS)
    a = req("a", range(9))
    kv.allocate_slots(a, 9)
    with pytest.raises(ValueError, match="already holds"):
        kv.get_computed_blocks(a)


def test_lru_eviction_of_unreferenced_cached_blocks():
    kv = KVCacheManager(num_blocks=7, block_size=BS)  # 6 usable blocks
    a = req("a", range(8))
    b = req("b", range(100, 108))
    for r in (a, b):
        kv.get_computed_blocks(r)
        compute(kv, r, 8)
    a_blocks, b_blocks = list(a.block_ids), list(b.block_ids)
    kv.free(a)  # released first: least recent; tail before head
    kv.free(b)
    assert kv.prefix_cache.evictable_block_ids() == a_blocks[::-1] + b_blocks[::-1]
    assert kv.block_pool.num_free_blocks == 2
    assert kv.num_free_blocks == 6
    # 3 new blocks: the 2 free ones first, then evict 1 (a's tail block).
    c = req("c", range(200, 212))
    assert kv.get_computed_blocks(c) == 0
    assert kv.allocate_slots(c, 12)
    assert a_blocks[1] in c.block_ids and a_blocks[0] not in c.block_ids
    assert kv.prefix_cache.evictable_block_ids() == [a_blocks[0]] + b_blocks[::-1]
    kv.check_integrity([c.block_ids])
    # a's head block still hits; b's whole prefix too.
    a2 = req("a2", range(9))
    assert kv.get_computed_blocks(a2) == 4
    assert a2.block_ids == a_blocks[:1]
    b2 = req("b2", list(range(100, 108)) + [7])
    assert kv.get_computed_blocks(b2) == 8
    assert b2.block_ids == b_blocks
    kv.check_integrity([c.block_ids, a2.block_ids, b2.block_ids])
    # Everything in use: no more room, and a failed allocation changes nothing.
    d = req("d", range(300, 305))
    assert kv.num_free_blocks == 0
    assert not kv.allocate_slots(d, 5)
    assert d.block_ids == []


def test_duplicate_prefix_computed_twice_caches_one_copy():
    kv = KVCacheManager(num_blocks=9, block_size=BS)
    a, b = req("a", range(8)), req("b", range(8))
    for r in (a, b):  # admitted in the same step: neither hits
        assert kv.get_computed_blocks(r) == 0
    for r in (a, b):
        compute(kv, r, 8)
    assert len(kv.prefix_cache) == 2
    assert kv.prefix_cache.cached_block_ids() == set(a.block_ids)
    kv.free(a)
    kv.free(b)
    assert kv.block_pool.num_used == 2
    assert kv.num_free_blocks == 8
    kv.check_integrity([])


def test_output_tokens_are_cached_too():
    kv = KVCacheManager(num_blocks=9, block_size=BS)
    a = req("a", range(6))
    kv.get_computed_blocks(a)
    compute(kv, a, 6)
    assert len(kv.prefix_cache) == 1
    a.output_token_ids += [50, 51]
    compute(kv, a, 2)  # 8 computed tokens: the second block is full
    assert len(kv.prefix_cache) == 2
    b = req("b", list(range(6)) + [50, 51, 52])
    assert kv.get_computed_blocks(b) == 8


def test_prefix_caching_disabled():
    kv = KVCacheManager(num_blocks=9, block_size=BS, enable_prefix_caching=False)
    a = req("a", range(8))
    kv.get_computed_blocks(a)
    compute(kv, a, 8)
    b = req("b", range(9))
    assert kv.get_computed_blocks(b) == 0
    kv.free(a)
    assert kv.block_pool.num_used == 0
    kv.check_integrity([])


def test_integrity_detects_a_leaked_block():
    kv = KVCacheManager(num_blocks=9, block_size=BS)
    a = req("a", range(6))
    kv.allocate_slots(a, 6)
    kv.check_integrity([a.block_ids])
    with pytest.raises(AssertionError, match="ref count 1 != 0 holding"):
        kv.check_integrity([])  # a's blocks are used but nobody claims them
    with pytest.raises(AssertionError, match="null block"):
        kv.check_integrity([a.block_ids + [0]])
