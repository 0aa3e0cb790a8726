"""Prefix cache: the hash chain and LRU order of evictable blocks."""

import pytest

from fastdeploy.cache_manager.prefix_cache import PrefixCache, hash_block_tokens, hash_full_blocks


def test_hash_chain_depends_on_whole_prefix():
    h_a = hash_block_tokens(None, [1, 2, 3, 4])
    h_b = hash_block_tokens(None, [9, 9, 9, 9])
    assert h_a == hash_block_tokens(None, [1, 2, 3, 4])
    assert len(h_a) == 32
    # Same block tokens after different prefixes hash differently.
    assert hash_block_tokens(h_a, [5, 6, 7, 8]) != hash_block_tokens(h_b, [5, 6, 7, 8])
    assert hash_block_tokens(None, [1, 2, 3, 4]) != hash_block_tokens(None, [4, 3, 2, 1])


def test_hash_full_blocks_skips_partial_block_and_extends():
    tokens = list(range(11))
    hashes = hash_full_blocks(tokens, 4)
    assert len(hashes) == 2
    assert hashes[0] == hash_block_tokens(None, [0, 1, 2, 3])
    assert hashes[1] == hash_block_tokens(hashes[0], [4, 5, 6, 7])
    more = hash_full_blocks(tokens + [11], 4, parent_hash=hashes[1], start=2)
    assert hash_full_blocks(tokens + [11], 4) == hashes + more


def test_lru_eviction_order():
    cache = PrefixCache()
    hashes = [hash_block_tokens(None, [i]) for i in range(4)]
    for i, h in enumerate(hashes):
        assert cache.insert(h, 10 + i)
    assert len(cache) == 4
    assert cache.num_evictable == 0
    for block_id in (10, 11, 12, 13):
        cache.release(block_id)
    cache.acquire(11)  # reused: no longer evictable
    assert cache.evictable_block_ids() == [10, 12, 13]
    cache.release(11)  # released again: now the most recent
    assert cache.evict(2) == [10, 12]
    assert cache.lookup(hashes[0]) is None
    assert cache.lookup(hashes[1]) == 11
    assert 10 not in cache and 11 in cache
    with pytest.raises(ValueError, match="only 2 are evictable"):
        cache.evict(3)
    cache.check_integrity()


def test_insert_keeps_first_block_for_a_hash():
    cache = PrefixCache()
    h = hash_block_tokens(None, [1, 2])
    assert cache.insert(h, 5)
    assert not cache.insert(h, 6)
    assert not cache.insert(hash_block_tokens(None, [3, 4]), 5)
    assert cache.lookup(h) == 5
    assert cache.cached_block_ids() == {5}
    with pytest.raises(ValueError, match="not in the prefix cache"):
        cache.release(6)
    cache.check_integrity()
