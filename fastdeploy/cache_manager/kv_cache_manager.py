"""KV cache manager: block tables of requests over a :class:`BlockPool`, with prefix caching.

Pure host logic. A request's block table is ``request.block_ids``: block ``i`` holds the KV of token
positions ``[i * block_size, (i + 1) * block_size)``.

Memory policy:
  * Blocks are allocated on demand, as the scheduler schedules tokens (:meth:`allocate_slots`), all
    or nothing per call.
  * With prefix caching, a FULL block whose KV has been computed is registered under its hash chain
    (:meth:`cache_full_blocks`). The cache keeps one pool reference on it, so when its last request
    frees it, it stays reusable (*evictable*) until the pool runs out of free blocks; evictable
    blocks are then evicted least recently released first (LRU), the tail blocks of a request
    before its head blocks (those are the likelier shared prefixes).
  * A cached block is never written again: admission caps the cached prefix to a block-aligned
    count below the request's length (:meth:`get_computed_blocks`).

KV-cache events (``enable_kv_cache_events``): every change of the prefix cache's set of hashes is
recorded as a vLLM event in a plain list (no I/O here): ``BlockStored`` when full blocks are
cached, ``BlockRemoved`` when they are evicted, ``AllBlocksCleared`` on
:meth:`reset_prefix_cache`; the engine takes them once per step (:meth:`take_events`) and hands
them to the publisher, as vLLM's ``BlockPool.take_events``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from fastdeploy.cache_manager.block_hash import external_block_hash, get_hash_fn
from fastdeploy.cache_manager.block_pool import BlockPool
from fastdeploy.cache_manager.prefix_cache import BlockHash, PrefixCache, hash_full_blocks
from fastdeploy.core.request import Request
from fastdeploy.distributed.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)

#: An entry of :meth:`KVCacheManager.take_newly_cached`.
NewlyCached = tuple[BlockHash, int, bool, "BlockHash | None", "list[int] | None"]


def fit_max_model_len(
    max_model_len: int, num_blocks: int, block_size: int
) -> tuple[int, str | None]:
    """The admission bound of a pool: ``max_model_len`` lowered, when needed, to the tokens one
    request can hold in ``num_blocks`` blocks of ``block_size`` tokens (the null block excluded),
    so that every admitted request fits the pool alone and a running request that outgrows the
    free blocks is preempted and later resumed rather than stuck (vLLM lowers it the same way).

    Returns:
        ``(max_model_len, note)``: ``note`` is None when nothing was lowered, else a sentence
        naming the numbers (for the start-up warning and every prompt refused for length).

    Raises:
        ValueError: the pool holds fewer than 2 tokens (no prompt could ever run).
    """
    capacity = (num_blocks - 1) * block_size
    if capacity < 2:
        raise ValueError(
            f"the KV cache holds {num_blocks - 1} usable block(s) of {block_size} tokens = "
            f"{capacity} token(s), too few for a prompt and one output token; raise "
            "num_gpu_blocks_override, gpu_memory_utilization or FD_CPU_KV_CACHE_SPACE"
        )
    if max_model_len <= capacity:
        return max_model_len, None
    note = (
        f"max_model_len lowered from {max_model_len} to {capacity} at start-up: the KV cache "
        f"holds {num_blocks - 1} blocks of {block_size} tokens"
    )
    return capacity, note


class KVCacheManager:
    """Block tables of requests over a pool of ``num_blocks`` KV blocks of ``block_size`` tokens.

    Block ``0`` is the pool's reserved null block, so ``num_blocks - 1`` blocks are usable.

    Args:
        hash_algo: the block hash function (``--prefix-caching-hash-algo``; see
            :mod:`fastdeploy.cache_manager.block_hash`).
        enable_kv_cache_events: record KV-cache events for :meth:`take_events`.

    Raises:
        ValueError: ``num_blocks < 2``, ``block_size < 1`` or an unknown ``hash_algo``.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        hash_algo: str = "sha256",
        enable_kv_cache_events: bool = False,
    ) -> None:
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ValueError(f"block_size={block_size!r} is invalid; allowed: an integer >= 1")
        get_hash_fn(hash_algo)  # an unknown name fails here
        self.hash_algo = hash_algo
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks)
        self.prefix_cache = PrefixCache() if enable_prefix_caching else None
        # Per request id: chain hashes of its full blocks computed so far (lazily extended), and
        # how many of its leading blocks were already offered to the prefix cache.
        self._block_hashes: dict[str, list[BlockHash]] = {}
        self._num_offered_blocks: dict[str, int] = {}
        # Blocks that entered the prefix cache since take_newly_cached() (None: not recorded).
        self._newly_cached: list[NewlyCached] | None = None
        # Prefix-cache lookups, in tokens (vLLM's PrefixCacheStats queries/hits): the tokens of
        # every request looked up at admission, and the tokens found cached.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # KV-cache events since take_events() (None: not recorded).
        self._events: list[KVCacheEvent] | None = [] if enable_kv_cache_events else None

    @property
    def num_blocks(self) -> int:
        """Total blocks, the null block included."""
        return self.block_pool.num_blocks

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that requests can use: ``num_blocks - 1``."""
        return self.block_pool.num_usable_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks available to :meth:`allocate_slots`: free blocks plus evictable cached blocks."""
        evictable = self.prefix_cache.num_evictable if self.prefix_cache is not None else 0
        return self.block_pool.num_free_blocks + evictable

    @property
    def max_num_tokens(self) -> int:
        """Most tokens one request can hold: ``num_usable_blocks * block_size``."""
        return self.num_usable_blocks * self.block_size

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests, in [0, 1] (evictable ones count as free)."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens: ``ceil(num_tokens / block_size)``."""
        return -(-num_tokens // self.block_size)

    def max_hit_blocks(self, request: Request) -> int:
        """Most leading blocks of ``request`` that a prefix-cache hit may cover (on any tier):
        full blocks strictly below its last token, so at least one token is computed (a logit
        to sample) and no token of a shared block is recomputed; see
        ``Request.max_prefix_hit_tokens`` (a request owing prompt logprobs reads no hit)."""
        return request.max_prefix_hit_tokens // self.block_size

    def block_hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """Chain hashes of the request's first ``num_blocks`` full blocks (fewer when it has
        fewer full blocks), computed once per request and kept until :meth:`free`."""
        return self._hashes(request, num_blocks)[:num_blocks]

    def record_newly_cached(self) -> None:
        """From now on, remember every block that enters the prefix cache, for
        :meth:`take_newly_cached` (the host tier writes them through)."""
        if self._newly_cached is None:
            self._newly_cached = []

    @property
    def num_newly_cached(self) -> int:
        """Blocks recorded since the last :meth:`take_newly_cached`."""
        return len(self._newly_cached or ())

    def take_newly_cached(self) -> list[NewlyCached]:
        """``(block_hash, block_id, is_prompt_block, parent_hash, token_ids)`` of the blocks that
        entered the prefix cache since the last call, in order; ``is_prompt_block``: it holds
        prompt tokens only; ``parent_hash`` (None for a first block) and the block's
        ``token_ids`` only when KV-cache events are on (else None and None), for the host
        tier's events. Empty unless :meth:`record_newly_cached` was called."""
        if self._newly_cached is None:
            return []
        taken, self._newly_cached = self._newly_cached, []
        return taken

    @property
    def records_events(self) -> bool:
        """KV-cache events are on (``enable_kv_cache_events``)."""
        return self._events is not None

    def take_events(self) -> list[KVCacheEvent]:
        """The KV-cache events recorded since the last call, in order (empty when events are
        off); the engine publishes them once per step."""
        if not self._events:
            return []
        taken, self._events = self._events, []
        return taken

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block, when no request or other holder uses one (vLLM's
        ``reset_prefix_cache``); records ``AllBlocksCleared``. Returns False, changing nothing,
        while a cached block is in use (or prefix caching is off)."""
        cache = self.prefix_cache
        if cache is None or cache.num_evictable != len(cache):
            return False
        self.block_pool.free([b for b, _ in cache.evict_entries(cache.num_evictable)])
        if self._newly_cached:
            self._newly_cached = []
        if self._events is not None:
            self._events.append(AllBlocksCleared())
        return True

    def get_computed_blocks(self, request: Request) -> int:
        """Attach the longest prefix-cached run of the request's full blocks; return its tokens.

        Called once on admission (also on re-admission after preemption, when the lookup covers
        the generated tokens too), with no blocks attached. Hit blocks are shared (one more pool
        reference each) and appended to ``request.block_ids``; ``request.num_cached_tokens`` and
        ``request.num_computed_tokens`` are set to the number of cached tokens.

        The cached count is capped to a multiple of ``block_size`` strictly below
        ``request.num_tokens``: at least one token must be computed so a logit can be sampled, and
        recomputing a token inside a shared block would overwrite it.

        Returns 0 when prefix caching is off.

        Raises:
            ValueError: the request already holds blocks or computed tokens.
        """
        if request.block_ids or request.num_computed_tokens:
            raise ValueError(
                f"request {request.request_id} already holds {len(request.block_ids)} blocks and "
                f"{request.num_computed_tokens} computed tokens; free it before a lookup"
            )
        request.num_cached_tokens = 0
        if self.prefix_cache is None or request.num_tokens == 0:
            return 0
        hits = []
        for block_hash in self.block_hashes(request, self.max_hit_blocks(request)):
            block_id = self.prefix_cache.lookup(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        self.block_pool.incref(hits)
        for block_id in hits:
            self.prefix_cache.acquire(block_id)
        request.block_ids = hits
        self._num_offered_blocks[request.request_id] = len(hits)
        num_cached = len(hits) * self.block_size
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_cached
        request.num_cached_tokens = num_cached
        request.num_computed_tokens = num_cached
        return num_cached

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Grow ``request.block_ids`` to cover ``num_computed_tokens + num_new_tokens`` tokens.

        Evicts LRU cached blocks when the free list is short. Returns False and changes nothing
        when even that is not enough.

        Raises:
            ValueError: ``num_new_tokens < 0``.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens={num_new_tokens} is invalid; allowed: >= 0")
        total = request.num_computed_tokens + num_new_tokens
        num_held = len(request.block_ids)
        if total <= num_held * self.block_size:
            return True  # covered already (most decode steps): no block to count
        num_needed = self.num_blocks_for(total) - num_held
        if num_needed > self.num_free_blocks:
            return False
        shortfall = num_needed - self.block_pool.num_free_blocks
        if shortfall > 0:
            evicted = self.prefix_cache.evict_entries(shortfall)
            self.block_pool.free([block_id for block_id, _ in evicted])
            if self._events is not None:
                self._events.append(
                    BlockRemoved([external_block_hash(h) for _, h in evicted], MEDIUM_GPU)
                )
        request.block_ids.extend(self.block_pool.allocate(num_needed))
        return True

    def cache_full_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's full blocks within its first ``num_computed_tokens`` tokens.

        Call after a step wrote their KV (prompt and generated tokens alike). Blocks already
        offered are skipped; a block whose prefix another block already caches stays private.
        No-op when prefix caching is off.

        Raises:
            ValueError: ``num_computed_tokens`` exceeds the request's tokens or its block table.
        """
        if self.prefix_cache is None:
            return
        if num_computed_tokens > request.num_tokens:
            raise ValueError(
                f"num_computed_tokens={num_computed_tokens} exceeds request "
                f"{request.request_id}'s {request.num_tokens} tokens"
            )
        num_full = num_computed_tokens // self.block_size
        if num_full > len(request.block_ids):
            raise ValueError(
                f"request {request.request_id} has {len(request.block_ids)} blocks, fewer than "
                f"the {num_full} full blocks of {num_computed_tokens} computed tokens"
            )
        start = self._num_offered_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = self._hashes(request, num_full)
        stored: list[int] = []  # indexes of the blocks cached now
        for i in range(start, num_full):
            block_id = request.block_ids[i]
            if self.prefix_cache.insert(hashes[i], block_id):
                self.block_pool.incref([block_id])
                stored.append(i)
                if self._newly_cached is not None:
                    self._newly_cached.append(self._newly_cached_entry(request, hashes, i))
        self._num_offered_blocks[request.request_id] = num_full
        if self._events is not None and stored:
            self._record_stored(request, hashes, stored)

    def _newly_cached_entry(self, request: Request, hashes: list[BlockHash], i: int) -> NewlyCached:
        size = self.block_size
        is_prompt = (i + 1) * size <= request.num_prompt_tokens
        if self._events is None:
            return hashes[i], request.block_ids[i], is_prompt, None, None
        parent = hashes[i - 1] if i > 0 else None
        tokens = request.all_token_ids[i * size : (i + 1) * size]
        return hashes[i], request.block_ids[i], is_prompt, parent, tokens

    def _record_stored(self, request: Request, hashes: list[BlockHash], stored: list[int]) -> None:
        """One ``BlockStored`` per run of consecutive newly cached blocks (indexes ``stored``,
        ascending) of ``request``; a run's parent is the hash of the block before it."""
        size = self.block_size
        tokens = request.all_token_ids
        run_start = 0
        for k in range(1, len(stored) + 1):
            if k < len(stored) and stored[k] == stored[k - 1] + 1:
                continue
            first, last = stored[run_start], stored[k - 1]
            self._events.append(
                BlockStored(
                    [external_block_hash(hashes[i]) for i in range(first, last + 1)],
                    external_block_hash(hashes[first - 1]) if first > 0 else None,
                    list(tokens[first * size : (last + 1) * size]),
                    size,
                    None,
                    MEDIUM_GPU,
                )
            )
            run_start = k

    def cache_known_blocks(self, requests: Iterable[Request]) -> None:
        """:meth:`cache_full_blocks` of each request over its computed tokens whose ids the host
        knows (``min(num_computed_tokens, num_tokens)``: under the overlap schedule the last
        computed token may be a placeholder), in order; the step loop calls it once per step.

        A request with no block filled since its last offer is skipped without a call: most
        decode steps fill none. Skipping it is exact: :meth:`cache_full_blocks` would change
        nothing, and could not raise, as its table holds every block offered so far. The test
        ``min(num_computed_tokens, num_tokens) // block_size > offered`` is written as both
        counts reaching the end of the next block, so a skipped request costs one comparison
        and no ``num_tokens`` (this runs twice a step for every running request).
        """
        if self.prefix_cache is None:
            return
        offered = self._num_offered_blocks
        block_size = self.block_size
        for request in requests:
            next_end = (offered.get(request.request_id, 0) + 1) * block_size
            computed = request.num_computed_tokens
            if computed >= next_end and request.num_tokens >= next_end:
                self.cache_full_blocks(request, min(computed, request.num_tokens))

    def free(self, request: Request) -> None:
        """Drop the request's reference on each of its blocks and clear ``request.block_ids``.

        Blocks go back to the pool, or, when cached, become evictable (tail blocks first, so they
        are evicted before the head blocks). Token counters are left to the caller.
        """
        self.release_blocks(request.block_ids)
        request.block_ids = []
        self._block_hashes.pop(request.request_id, None)
        self._num_offered_blocks.pop(request.request_id, None)

    def hold_blocks(self, block_ids: Sequence[int]) -> None:
        """Take one more reference on each block, for a holder other than a request (a prefill
        node's pending send, a host-tier store in flight); :meth:`release_blocks` gives it back.
        A cached block that no request used (evictable) is not evictable while held."""
        self.block_pool.incref(list(block_ids))
        if self.prefix_cache is not None:
            for block_id in block_ids:
                if block_id in self.prefix_cache:
                    self.prefix_cache.acquire(block_id)

    def release_blocks(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block, last block first: a block goes back to the pool, or,
        when cached and now unused, becomes evictable (tail blocks before head blocks)."""
        for block_id in reversed(block_ids):
            self.block_pool.free([block_id])
            if (
                self.prefix_cache is not None
                and block_id in self.prefix_cache
                and self.block_pool.ref_count(block_id) == 1
            ):
                self.prefix_cache.release(block_id)

    def check_integrity(self, held_block_ids: Iterable[Sequence[int]] | None = None) -> None:
        """Check the pool, the prefix cache and their agreement.

        With ``held_block_ids`` (the block tables of every request holding blocks), also check that
        each block's reference count equals its holders plus one if cached, so the used blocks are
        exactly the held ones plus the cached ones (no leak, no dangling table).

        Raises:
            AssertionError: naming the first broken invariant.
        """
        pool = self.block_pool
        pool.check_integrity()
        cached: set[int] = set()
        if self.prefix_cache is not None:
            self.prefix_cache.check_integrity()
            cached = self.prefix_cache.cached_block_ids()
            for block_id in cached:
                if pool.ref_count(block_id) < 1:
                    raise AssertionError(f"cached block {block_id} is free in the pool")
            evictable = set(self.prefix_cache.evictable_block_ids())
            unused = {b for b in cached if pool.ref_count(b) == 1}
            if evictable != unused:
                raise AssertionError(
                    f"evictable blocks {sorted(evictable)[:8]} != cached blocks no request uses "
                    f"{sorted(unused)[:8]}"
                )
        if held_block_ids is None:
            return
        holders = Counter(b for table in held_block_ids for b in table)
        if 0 in holders:
            raise AssertionError("a block table holds the null block 0")
        for block_id in range(1, pool.num_blocks):
            expected = holders[block_id] + (block_id in cached)
            if pool.ref_count(block_id) != expected:
                raise AssertionError(
                    f"block {block_id}: ref count {pool.ref_count(block_id)} != "
                    f"{holders[block_id]} holding requests + {int(block_id in cached)} prefix cache"
                )

    def _hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """Chain hashes of at least the request's first ``num_blocks`` full blocks (if known)."""
        hashes = self._block_hashes.setdefault(request.request_id, [])
        if len(hashes) < num_blocks:
            parent = hashes[-1] if hashes else None
            hashes.extend(
                hash_full_blocks(
                    request.all_token_ids, self.block_size, parent, len(hashes), self.hash_algo
                )
            )
        return hashes
