"""Runs of KV blocks: one copy or one transfer descriptor per run instead of one per block.

Used wherever blocks move between two block tables: host-tier stores and swap-ins
(:mod:`fastdeploy.worker.host_kv_pool`) and PD transfers (the ``nixl`` transport). The number of
copies (descriptors), not the bytes, is what makes small-block transfers slow.
"""

from __future__ import annotations

from collections.abc import Sequence


def merge_block_runs(src_ids: Sequence[int], dst_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """Runs where both block-id lists are consecutive, as ``(src_first, dst_first, count)``, in
    order; ``src_ids[i]`` moves to ``dst_ids[i]``.

    >>> merge_block_runs([3, 4, 5, 9], [1, 2, 7, 8])
    [(3, 1, 2), (5, 7, 1), (9, 8, 1)]
    """
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_ids, dst_ids):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs
