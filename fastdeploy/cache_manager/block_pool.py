"""The pool of paged KV cache blocks: a free list and per-block reference counts.

Pure host bookkeeping (no device memory): a block id indexes the KV cache tensors that the model
runner owns. Block ``0`` is reserved as the null block: it is never handed out, so the runner can
pad block tables (and CUDA-graph batches) with ``0`` without touching a live block. Of
``num_blocks`` blocks, ``num_blocks - 1`` are therefore usable.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

NULL_BLOCK_ID = 0


class NoFreeBlocksError(RuntimeError):
    """Raised by :meth:`BlockPool.allocate` when fewer blocks are free than asked for."""


class BlockPool:
    """Free list and reference counts of ``num_blocks`` KV blocks (block ``0`` reserved).

    A block is *free* (reference count 0, on the free list) or *used* (count >= 1). Allocation
    hands out free blocks with count 1; :meth:`incref` shares a used block (prefix caching);
    :meth:`free` drops one reference per id and returns blocks whose count reaches 0 to the free
    list.

    Allocation policy: :meth:`allocate` is all-or-nothing and raises :class:`NoFreeBlocksError`
    when short, so a caller that must not fail checks :attr:`num_free_blocks` first.

    Raises:
        ValueError: ``num_blocks < 2`` (one usable block plus the null block is the minimum).
    """

    def __init__(self, num_blocks: int) -> None:
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 2:
            raise ValueError(
                f"num_blocks={num_blocks!r} is invalid; allowed: an integer >= 2 "
                "(block 0 is the reserved null block)"
            )
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(1, num_blocks))

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can ever be allocated: ``num_blocks - 1`` (the null block excluded)."""
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks on the free list."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Blocks with a reference count >= 1."""
        return self.num_usable_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks that are used, in [0, 1]."""
        return self.num_used / self.num_usable_blocks

    def ref_count(self, block_id: int) -> int:
        """Reference count of one block (0 for a free block and for the null block)."""
        if block_id != NULL_BLOCK_ID:
            self._check_id(block_id)
        return self._ref_counts[block_id]

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks, each with reference count 1, in free-list order.

        Raises:
            ValueError: ``n < 0``.
            NoFreeBlocksError: fewer than ``n`` blocks are free (nothing is allocated then).
        """
        if n < 0:
            raise ValueError(f"cannot allocate n={n} blocks; allowed: n >= 0")
        if n > len(self._free):
            raise NoFreeBlocksError(
                f"asked for {n} KV blocks but only {len(self._free)} of "
                f"{self.num_usable_blocks} are free"
            )
        block_ids = [self._free.popleft() for _ in range(n)]
        for block_id in block_ids:
            self._ref_counts[block_id] = 1
        return block_ids

    def incref(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each (used) block, e.g. when a request shares a cached block.

        Raises:
            ValueError: a block id is out of range, the null block, or free.
        """
        for block_id in block_ids:
            self._check_id(block_id)
            if self._ref_counts[block_id] == 0:
                raise ValueError(f"cannot share block {block_id}: it is free")
            self._ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> list[int]:
        """Drop one reference from each block; blocks reaching 0 go to the end of the free list.

        Returns the ids that became free, in the order given.

        Raises:
            ValueError: a block id is out of range, the null block, or already free (double free).
        """
        released = []
        for block_id in block_ids:
            self._check_id(block_id)
            if self._ref_counts[block_id] == 0:
                raise ValueError(f"double free of KV block {block_id}")
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free.append(block_id)
                released.append(block_id)
        return released

    def used_block_ids(self) -> set[int]:
        """Ids of the blocks with a reference count >= 1."""
        return {b for b in range(1, self.num_blocks) if self._ref_counts[b] > 0}

    def check_integrity(self) -> None:
        """Check free + used == usable, no block both free and used, the null block untouched.

        Raises:
            AssertionError: naming the first broken invariant.
        """
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a block is on the free list twice")
        if NULL_BLOCK_ID in free or self._ref_counts[NULL_BLOCK_ID] != 0:
            raise AssertionError("the null block 0 was handed out or freed")
        used = self.used_block_ids()
        if free & used:
            raise AssertionError(f"blocks both free and used: {sorted(free & used)[:8]}")
        if len(free) + len(used) != self.num_usable_blocks:
            raise AssertionError(
                f"free ({len(free)}) + used ({len(used)}) != usable ({self.num_usable_blocks})"
            )
        if any(c < 0 for c in self._ref_counts):
            raise AssertionError("a negative reference count")

    def _check_id(self, block_id: int) -> None:
        if not (isinstance(block_id, int) and 1 <= block_id < self.num_blocks):
            raise ValueError(
                f"block_id={block_id!r} is invalid; allowed: 1 .. {self.num_blocks - 1} "
                "(0 is the null block)"
            )
