"""BlockPool: allocation, sharing, free, integrity (host only)."""

import pytest

from fastdeploy.cache_manager.block_pool import NULL_BLOCK_ID, BlockPool, NoFreeBlocksError


def test_null_block_is_reserved():
    pool = BlockPool(5)
    assert pool.num_usable_blocks == 4
    assert pool.num_free_blocks == 4
    assert pool.num_used == 0
    assert pool.usage == 0.0
    block_ids = pool.allocate(4)
    assert sorted(block_ids) == [1, 2, 3, 4]
    assert NULL_BLOCK_ID not in block_ids
    assert pool.ref_count(NULL_BLOCK_ID) == 0
    with pytest.raises(ValueError, match="null block"):
        pool.free([NULL_BLOCK_ID])


@pytest.mark.parametrize("num_blocks", [0, 1, -3, True, 2.0])
def test_too_few_blocks_is_rejected(num_blocks):
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(num_blocks)


def test_allocate_and_free_counts():
    pool = BlockPool(9)
    a = pool.allocate(3)
    assert a == [1, 2, 3]
    assert [pool.ref_count(b) for b in a] == [1, 1, 1]
    assert pool.num_free_blocks == 5
    assert pool.num_used == 3
    assert pool.usage == pytest.approx(3 / 8)
    assert pool.allocate(0) == []
    assert pool.free(a[:2]) == [1, 2]
    assert pool.num_used == 1
    # Freed blocks go to the back of the free list.
    assert pool.allocate(6) == [4, 5, 6, 7, 8, 1]
    pool.check_integrity()


def test_allocate_is_all_or_nothing():
    pool = BlockPool(4)
    pool.allocate(2)
    with pytest.raises(NoFreeBlocksError, match="asked for 2 KV blocks but only 1"):
        pool.allocate(2)
    assert pool.num_free_blocks == 1
    with pytest.raises(ValueError):
        pool.allocate(-1)
    pool.check_integrity()


def test_shared_block_needs_every_reference_freed():
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    pool.incref([b])
    pool.incref([b])
    assert pool.ref_count(b) == 3
    assert pool.free([b]) == []
    assert pool.free([b]) == []
    assert pool.num_used == 1
    assert pool.free([b]) == [b]
    assert pool.num_used == 0
    with pytest.raises(ValueError, match="double free"):
        pool.free([b])
    with pytest.raises(ValueError, match="free"):
        pool.incref([b])
    with pytest.raises(ValueError, match="block_id"):
        pool.free([4])
    pool.check_integrity()


def test_integrity_detects_corruption():
    pool = BlockPool(6)
    used = pool.allocate(2)
    pool.check_integrity()
    pool._free.append(used[0])  # a used block also on the free list
    with pytest.raises(AssertionError):
        pool.check_integrity()
    pool._free.pop()
    pool._ref_counts[used[1]] = 0  # a block neither free nor used
    with pytest.raises(AssertionError, match="free .* used .* usable"):
        pool.check_integrity()
