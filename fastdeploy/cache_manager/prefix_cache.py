"""Prefix caching: a map from the hash of a full KV block's token prefix to the block holding it.

Each FULL block of a sequence is named by a hash chain, ``h_i = H(h_{i-1}, tokens of block i)``,
so equal hashes mean equal whole prefixes. ``H`` and the first block's parent are vLLM's
(:mod:`fastdeploy.cache_manager.block_hash`), so a router computes the same hashes from the same
token ids. Only token ids are hashed (no LoRA or multimodal keys: the engine has neither).

The cache holds one reference on every cached block in the :class:`BlockPool` (taken by the
:class:`~fastdeploy.cache_manager.kv_cache_manager.KVCacheManager`), so a cached block that no
request uses any more stays *used* in the pool and reusable. Such blocks are *evictable*; they are
kept in least-recently-released order and evicted from the front (LRU) when the pool needs space.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from fastdeploy.cache_manager.block_hash import BlockHash, hash_block_tokens

__all__ = ["BlockHash", "PrefixCache", "hash_block_tokens", "hash_full_blocks"]


def hash_full_blocks(
    token_ids: Sequence[int],
    block_size: int,
    parent_hash: BlockHash | None = None,
    start: int = 0,
    algo: str = "sha256",
) -> list[BlockHash]:
    """Chain hashes of the full blocks of ``token_ids`` from block index ``start`` on.

    ``parent_hash`` must be the hash of block ``start - 1`` (``None`` when ``start == 0``). A
    trailing partial block is not hashed. ``algo``: see
    :func:`~fastdeploy.cache_manager.block_hash.hash_block_tokens`.
    """
    hashes = []
    for i in range(start, len(token_ids) // block_size):
        parent_hash = hash_block_tokens(
            parent_hash, token_ids[i * block_size : (i + 1) * block_size], algo
        )
        hashes.append(parent_hash)
    return hashes


class PrefixCache:
    """Map ``BlockHash -> block id`` plus the LRU list of evictable (unreferenced) cached blocks.

    It knows nothing of reference counts: the KV cache manager tells it when a cached block loses
    its last request (:meth:`release`) or gains one (:meth:`acquire`), and frees the blocks that
    :meth:`evict` returns.
    """

    def __init__(self) -> None:
        self._block_of: dict[BlockHash, int] = {}
        self._hash_of: dict[int, BlockHash] = {}
        # Evictable block ids, least recently released first (values unused).
        self._evictable: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        """Number of cached blocks (evictable or in use)."""
        return len(self._block_of)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._hash_of

    @property
    def num_evictable(self) -> int:
        """Cached blocks that no request uses (the cache's reference is their only one)."""
        return len(self._evictable)

    def cached_block_ids(self) -> set[int]:
        """Ids of all cached blocks."""
        return set(self._hash_of)

    def evictable_block_ids(self) -> list[int]:
        """Evictable block ids, next to be evicted first."""
        return list(self._evictable)

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The block id cached under ``block_hash``, or ``None``."""
        return self._block_of.get(block_hash)

    def insert(self, block_hash: BlockHash, block_id: int) -> bool:
        """Cache ``block_id`` (in use by a request) under ``block_hash``.

        Returns False, caching nothing, when the hash is already cached (another block computed the
        same prefix first) or the block is already cached; the caller takes the pool reference for
        the cache only on True.
        """
        if block_hash in self._block_of or block_id in self._hash_of:
            return False
        self._block_of[block_hash] = block_id
        self._hash_of[block_id] = block_hash
        return True

    def acquire(self, block_id: int) -> None:
        """A request starts using a cached block: it is no longer evictable."""
        self._evictable.pop(block_id, None)

    def release(self, block_id: int) -> None:
        """The last request using cached ``block_id`` let go: it becomes the most recent evictable.

        Raises:
            ValueError: the block is not cached.
        """
        if block_id not in self._hash_of:
            raise ValueError(f"block {block_id} is not in the prefix cache")
        self._evictable[block_id] = None
        self._evictable.move_to_end(block_id)

    def evict(self, n: int) -> list[int]:
        """Forget the ``n`` least recently released evictable blocks and return their ids.

        The caller drops the cache's pool reference on them (which frees them).

        Raises:
            ValueError: fewer than ``n`` blocks are evictable.
        """
        return [block_id for block_id, _ in self.evict_entries(n)]

    def evict_entries(self, n: int) -> list[tuple[int, BlockHash]]:
        """:meth:`evict`, returning ``(block_id, block_hash)`` of each evicted block.

        Raises:
            ValueError: fewer than ``n`` blocks are evictable.
        """
        if n > len(self._evictable):
            raise ValueError(f"cannot evict {n} blocks; only {len(self._evictable)} are evictable")
        evicted = []
        for _ in range(n):
            block_id, _ = self._evictable.popitem(last=False)
            block_hash = self._hash_of.pop(block_id)
            del self._block_of[block_hash]
            evicted.append((block_id, block_hash))
        return evicted

    def hash_of(self, block_id: int) -> BlockHash | None:
        """The hash ``block_id`` is cached under, or ``None``."""
        return self._hash_of.get(block_id)

    def cached_hashes(self) -> set[BlockHash]:
        """Hashes of all cached blocks."""
        return set(self._block_of)

    def check_integrity(self) -> None:
        """Check that the two maps are inverse and evictable blocks are cached.

        Raises:
            AssertionError: naming the broken invariant.
        """
        if len(self._block_of) != len(self._hash_of):
            raise AssertionError("hash->block and block->hash maps differ in size")
        for block_hash, block_id in self._block_of.items():
            if self._hash_of.get(block_id) != block_hash:
                raise AssertionError(f"block {block_id} is cached under two hashes")
        stray = [b for b in self._evictable if b not in self._hash_of]
        if stray:
            raise AssertionError(f"evictable blocks that are not cached: {stray[:8]}")
