"""The host (CPU) tier's prefix cache: which host block holds which block hash, and when it may be
hit, evicted or overwritten (``docs/pd-disaggregation.md``, shared docs, "Host tier").

Pure host bookkeeping, like the device prefix cache. A host block moves through:

* free -> **storing** (:meth:`HostPrefixCache.reserve`): a device-to-host copy is in flight; the
  block cannot be hit (a hit could read half-written bytes) and cannot be evicted;
* storing -> **published** (:meth:`HostPrefixCache.publish`, once the copy's event completed): it
  can be hit; it is evictable, least recently used first, unless pinned;
* published + **pinned** (:meth:`HostPrefixCache.pin`, a swap-in reads it): not evictable until
  :meth:`HostPrefixCache.unpin`;
* storing -> free (:meth:`HostPrefixCache.cancel`): the copy was abandoned.

Every host block is usable (there is no null block on the host).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from fastdeploy.cache_manager.prefix_cache import BlockHash


class HostPrefixCache:
    """Block hash -> host block, with publish-after-copy, pins and LRU eviction.

    Args:
        num_blocks: host blocks (``swap_space`` bytes / bytes per block).
        record_evictions: remember the hashes of evicted published blocks for
            :meth:`take_evicted` (the host tier's ``BlockRemoved`` events).

    Raises:
        ValueError: ``num_blocks < 1``.
    """

    def __init__(self, num_blocks: int, record_evictions: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"host num_blocks={num_blocks} is invalid; allowed: >= 1")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() gives 0, 1, ...
        self._block_of: dict[BlockHash, int] = {}
        self._hash_of: dict[int, BlockHash] = {}
        self._storing: set[int] = set()
        self._pins: dict[int, int] = {}
        # Published, unpinned blocks, least recently used first.
        self._lru: OrderedDict[int, None] = OrderedDict()
        # Hashes of published blocks evicted since take_evicted() (None: not recorded).
        self._evicted: list[BlockHash] | None = [] if record_evictions else None

    # ------------------------------------------------------------------ queries
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_published(self) -> int:
        return len(self._hash_of) - len(self._storing)

    @property
    def usage(self) -> float:
        """Share of host blocks in use, in [0, 1]."""
        return self.num_used / self.num_blocks

    def storing_blocks(self) -> set[int]:
        """Host blocks whose store is in flight (reserved, not yet published)."""
        return set(self._storing)

    def pin_counts(self) -> dict[int, int]:
        """Pinned host block -> number of swap-ins reading it."""
        return dict(self._pins)

    def published_hashes(self) -> set[BlockHash]:
        """Hashes of the published blocks (those a lookup can hit)."""
        return {h for b, h in self._hash_of.items() if b not in self._storing}

    def take_evicted(self) -> list[BlockHash]:
        """Hashes of the published blocks evicted since the last call, in order (empty unless
        ``record_evictions``)."""
        if not self._evicted:
            return []
        taken, self._evicted = self._evicted, []
        return taken

    def contains(self, block_hash: BlockHash) -> bool:
        """The hash is on the host, stored or still storing (no second store is needed)."""
        return block_hash in self._block_of

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The published host block of ``block_hash``, or None (absent or still storing)."""
        block = self._block_of.get(block_hash)
        return None if block is None or block in self._storing else block

    def match_prefix(self, hashes: Sequence[BlockHash]) -> list[int]:
        """Host blocks of the longest run of published ``hashes`` from the front (a hash chain:
        the first miss ends it). Marks them recently used."""
        blocks = []
        for h in hashes:
            block = self.lookup(h)
            if block is None:
                break
            blocks.append(block)
            if block in self._lru:
                self._lru.move_to_end(block)
        return blocks

    # ------------------------------------------------------------------ stores
    def reserve(self, block_hash: BlockHash) -> int | None:
        """A host block to copy ``block_hash``'s device block into, evicting the least recently
        used published block when none is free. None when the hash is already on the host or no
        block can be had (everything storing or pinned); then nothing is stored."""
        if block_hash in self._block_of:
            return None
        if not self._free:
            if not self._lru:
                return None
            victim = self._lru.popitem(last=False)[0]
            if self._evicted is not None:
                self._evicted.append(self._hash_of[victim])
            self._forget(victim)
        block = self._free.pop()
        self._block_of[block_hash] = block
        self._hash_of[block] = block_hash
        self._storing.add(block)
        return block

    def publish(self, block: int) -> None:
        """The copy into ``block`` landed: it can be hit from now on.

        Raises:
            ValueError: ``block`` is not storing.
        """
        if block not in self._storing:
            raise ValueError(f"host block {block} is not storing")
        self._storing.discard(block)
        self._lru[block] = None

    def cancel(self, block: int) -> None:
        """The copy into ``block`` was abandoned: free it.

        Raises:
            ValueError: ``block`` is not storing.
        """
        if block not in self._storing:
            raise ValueError(f"host block {block} is not storing")
        self._storing.discard(block)
        self._forget(block)

    # ------------------------------------------------------------------ reads
    def pin(self, blocks: Sequence[int]) -> None:
        """A swap-in reads ``blocks``: they cannot be evicted until :meth:`unpin`.

        Raises:
            ValueError: a block that is not published.
        """
        for block in blocks:
            if block not in self._hash_of or block in self._storing:
                raise ValueError(f"host block {block} is not published")
        for block in blocks:
            self._pins[block] = self._pins.get(block, 0) + 1
            self._lru.pop(block, None)

    def unpin(self, blocks: Sequence[int]) -> None:
        """The swap-in's copies out of ``blocks`` landed.

        Raises:
            ValueError: a block that is not pinned.
        """
        for block in blocks:
            count = self._pins.get(block, 0)
            if count == 0:
                raise ValueError(f"host block {block} is not pinned")
            if count == 1:
                del self._pins[block]
                self._lru[block] = None  # most recently used
            else:
                self._pins[block] = count - 1

    # ------------------------------------------------------------------ internals
    def _forget(self, block: int) -> None:
        del self._block_of[self._hash_of.pop(block)]
        self._free.append(block)

    def check_integrity(self) -> None:
        """free + storing + pinned + evictable == all blocks, each in exactly one state.

        Raises:
            AssertionError: naming the broken invariant.
        """
        free = set(self._free)
        pinned = set(self._pins)
        lru = set(self._lru)
        states = (free, self._storing, pinned, lru)
        if sum(len(s) for s in states) != self.num_blocks or len(free) != len(self._free):
            raise AssertionError(
                f"host blocks: {len(free)} free + {len(self._storing)} storing + {len(pinned)} "
                f"pinned + {len(lru)} evictable != {self.num_blocks}"
            )
        if free & (self._storing | pinned | lru) or self._storing & (pinned | lru) or pinned & lru:
            raise AssertionError("a host block is in two states")
        if set(self._hash_of) != self._storing | pinned | lru:
            raise AssertionError("cached host blocks differ from storing + pinned + evictable")
        if len(self._block_of) != len(self._hash_of):
            raise AssertionError("hash->block and block->hash maps differ in size")
