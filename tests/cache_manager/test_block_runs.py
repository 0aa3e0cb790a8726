"""Block runs: one copy or descriptor per run of blocks consecutive on both sides."""

from __future__ import annotations

from fastdeploy.cache_manager.block_runs import merge_block_runs


def test_runs_need_both_sides_consecutive():
    assert merge_block_runs([3, 4, 5, 9], [1, 2, 7, 8]) == [(3, 1, 2), (5, 7, 1), (9, 8, 1)]
    assert merge_block_runs([2, 3, 7, 8], [0, 1, 4, 6]) == [(2, 0, 2), (7, 4, 1), (8, 6, 1)]
    same = [3, 4, 5, 9, 10, 2]
    assert merge_block_runs(same, same) == [(3, 3, 3), (9, 9, 2), (2, 2, 1)]
    assert merge_block_runs([], []) == []
