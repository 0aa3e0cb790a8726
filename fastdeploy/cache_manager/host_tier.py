"""The host KV tier's bookkeeping: write-through of prefix-cached blocks to host memory, the
host half of the two-tier prefix lookup, and the swap-ins of host hits
(``docs/pd-disaggregation.md``, shared docs, "Host tier").

Pure host logic, run on the engine's thread; the copies themselves are issued by a
:class:`BlockCopier` (the worker) and end with a :class:`CopyJob` that is polled, never waited on.

Per step, in this order (see ``LLMEngine.step``):

1. :meth:`HostTier.begin_step` issues the stores of the blocks that entered the device prefix
   cache during the previous step (their hash not on the host yet), then polls every copy in
   flight: a landed store publishes its host blocks and releases its device blocks; a landed
   swap-in unpins its host blocks and is returned so the scheduler can run its request.
2. The scheduler admits requests; :meth:`HostTier.lookup` continues a device prefix hit on the
   host and :meth:`HostTier.start_swap_in` pins the hits once their device blocks are allocated.
3. :meth:`HostTier.issue_swap_ins` copies this step's swap-ins back, in one job: one event for
   ``swap_in_mode="request"`` (the requests wait in ``WAITING_FOR_SWAP_IN``), one event per layer
   for ``"layerwise"`` (returned for each layer to wait on before its KV store, inside this
   step's forward).

Fences (what keeps a copy from reading or writing a block someone else owns):

* a device block with a store in flight holds one more pool reference, so it cannot be evicted
  or reused until the store landed;
* a host block being stored is not published (cannot be hit) and cannot be evicted; a host block
  being read by a swap-in is pinned;
* a request aborted while its swap-in is in flight keeps its device blocks (the scheduler parks
  them) until the copy landed.

KV-cache events (when the device manager records them): a host block that is published emits
``BlockStored`` (medium ``"CPU"``, with its parent hash and token ids), a published host block
evicted for a new store emits ``BlockRemoved`` (medium ``"CPU"``); :meth:`HostTier.take_events`
hands them to the engine with the device tier's.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from fastdeploy.cache_manager.block_hash import BlockHash, external_block_hash
from fastdeploy.cache_manager.host_cache import HostPrefixCache
from fastdeploy.cache_manager.kv_cache_manager import KVCacheManager
from fastdeploy.config import HOST_STORE_POLICIES, SWAP_IN_MODES
from fastdeploy.core.request import Request
from fastdeploy.distributed.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored, KVCacheEvent


class CopyJob(Protocol):
    """Copies in flight (``fastdeploy.worker.host_kv_pool.CopyJob``)."""

    events: list

    def done(self) -> bool:
        """Every copy of the job landed (no host sync)."""
        ...


class BlockCopier(Protocol):
    """Who issues block copies between the device KV cache and the host pool (the worker)."""

    def store_blocks(self, device_blocks: Sequence[int], host_blocks: Sequence[int]) -> CopyJob:
        """Device -> host, every layer of each block."""
        ...

    def load_blocks(
        self, host_blocks: Sequence[int], device_blocks: Sequence[int], per_layer: bool
    ) -> CopyJob:
        """Host -> device, every layer; ``per_layer``: one event per layer, in layer order."""
        ...


@dataclass
class _Store:
    job: CopyJob
    device_blocks: list[int]
    host_blocks: list[int]


@dataclass
class _SwapIn:
    request: Request
    host_blocks: list[int]
    device_blocks: list[int]
    job: Any = None
    issued_at: float = 0.0


@dataclass
class HostTierStats:
    """Cumulative counters (tokens, bytes, seconds) since start-up."""

    hit_tokens: int = 0
    swap_in_bytes: int = 0
    swap_in_seconds: float = 0.0
    store_bytes: int = 0
    stores_skipped: int = 0


class HostTier:
    """Two-tier prefix caching glue between the device :class:`KVCacheManager` and a
    :class:`HostPrefixCache` of ``num_host_blocks`` blocks.

    Args:
        kv_cache_manager: the device tier (its prefix cache must be on).
        num_host_blocks: host blocks (``swap_space`` bytes / ``bytes_per_block``).
        bytes_per_block: bytes of one block over all layers (for the byte counters).
        copier: issues the copies (the worker).
        swap_in_mode: ``request`` or ``layerwise`` (see the module docstring).
        store_policy: ``prompt`` (blocks of prompt tokens only) or ``all`` (decode blocks too).

    Raises:
        ValueError: prefix caching off, ``num_host_blocks < 1``, or an unknown mode or policy.
    """

    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        num_host_blocks: int,
        bytes_per_block: int,
        copier: BlockCopier,
        swap_in_mode: str = "request",
        store_policy: str = "prompt",
    ) -> None:
        if kv_cache_manager.prefix_cache is None:
            raise ValueError("the host KV tier needs prefix caching (enable_prefix_caching=True)")
        if swap_in_mode not in SWAP_IN_MODES:
            raise ValueError(
                f"swap_in_mode={swap_in_mode!r} is invalid; allowed: {', '.join(SWAP_IN_MODES)}"
            )
        if store_policy not in HOST_STORE_POLICIES:
            raise ValueError(
                f"host_store_policy={store_policy!r} is invalid; allowed: "
                f"{', '.join(HOST_STORE_POLICIES)}"
            )
        self.kv = kv_cache_manager
        self.events_on = kv_cache_manager.records_events
        self.host = HostPrefixCache(num_host_blocks, record_evictions=self.events_on)
        # Host block -> (hash, parent hash, token ids) of its store in flight (events only).
        self._store_meta: dict[int, tuple[BlockHash, BlockHash | None, list[int]]] = {}
        self._events: list[KVCacheEvent] = []
        self.bytes_per_block = bytes_per_block
        self.copier = copier
        self.layerwise = swap_in_mode == "layerwise"
        self.store_policy = store_policy
        self.stats = HostTierStats()
        self._stores: list[_Store] = []
        self._new_swap_ins: list[_SwapIn] = []  # started, copies not issued yet
        self._swap_ins: list[_SwapIn] = []  # copies in flight
        kv_cache_manager.record_newly_cached()

    # ------------------------------------------------------------ admission (scheduler)
    def lookup(self, request: Request) -> list[int]:
        """Published host blocks that continue the request's device prefix hit: call right
        after ``KVCacheManager.get_computed_blocks`` (``request.block_ids`` are the device
        hits). The walk follows the hash chain and stops at the first miss or at
        ``KVCacheManager.max_hit_blocks``. Nothing is pinned yet (see :meth:`start_swap_in`)."""
        first = len(request.block_ids)
        hashes = self.kv.block_hashes(request, self.kv.max_hit_blocks(request))[first:]
        return self.host.match_prefix(hashes)

    def start_swap_in(
        self, request: Request, host_blocks: Sequence[int], device_blocks: Sequence[int]
    ) -> None:
        """The request got ``device_blocks`` for its host hits ``host_blocks`` (same length, in
        order): pin the host blocks and queue the copy for :meth:`issue_swap_ins`.

        Raises:
            ValueError: lengths differ, or a host block is no longer published.
        """
        if len(host_blocks) != len(device_blocks) or not host_blocks:
            raise ValueError(
                f"swap-in of request {request.request_id!r}: {len(host_blocks)} host blocks for "
                f"{len(device_blocks)} device blocks; allowed: the same non-zero number"
            )
        self.host.pin(host_blocks)
        self._new_swap_ins.append(_SwapIn(request, list(host_blocks), list(device_blocks)))
        self.stats.hit_tokens += len(host_blocks) * self.kv.block_size

    # ------------------------------------------------------------ the step (engine)
    def begin_step(self) -> list[Request]:
        """Issue the stores of newly cached device blocks, then poll the copies in flight.

        Call at the start of a step, before the scheduler allocates (so that no block waiting
        for its store can have been evicted). Returns the requests whose swap-in landed since
        the last call (aborted ones included: the scheduler frees their parked blocks)."""
        self._issue_stores()
        still = []
        for store in self._stores:
            if not store.job.done():
                still.append(store)
                continue
            for block in store.host_blocks:
                self.host.publish(block)
                if self.events_on:
                    self._record_stored(block)
            self.kv.release_blocks(store.device_blocks)
            self.stats.store_bytes += len(store.host_blocks) * self.bytes_per_block
        self._stores = still
        landed, still_in, timed = [], [], set()
        now = time.monotonic()
        for swap in self._swap_ins:
            if not swap.job.done():
                still_in.append(swap)
                continue
            self.host.unpin(swap.host_blocks)
            if id(swap.job) not in timed:  # one job carries every swap-in of its step
                timed.add(id(swap.job))
                self.stats.swap_in_seconds += now - swap.issued_at
            landed.append(swap.request)
        self._swap_ins = still_in
        return landed

    def issue_swap_ins(self) -> list | None:
        """Copy the swap-ins started since the last call back to the device, in one job.

        Returns the job's per-layer events in ``layerwise`` mode (for this step's forward to
        wait on, layer by layer; empty on CPU, where copies are done at once), else None."""
        swaps, self._new_swap_ins = self._new_swap_ins, []
        if not swaps:
            return [] if self.layerwise else None
        host = [b for s in swaps for b in s.host_blocks]
        device = [b for s in swaps for b in s.device_blocks]
        job = self.copier.load_blocks(host, device, per_layer=self.layerwise)
        now = time.monotonic()
        for s in swaps:
            s.job, s.issued_at = job, now
        self._swap_ins += swaps
        self.stats.swap_in_bytes += len(host) * self.bytes_per_block
        return list(job.events) if self.layerwise else None

    def _issue_stores(self) -> None:
        """Reserve host blocks for the newly cached device blocks whose hash is not on the host,
        pin those device blocks (one more reference) and issue one store for all of them."""
        prefix_cache = self.kv.prefix_cache
        device, host = [], []
        for block_hash, block_id, is_prompt, parent, tokens in self.kv.take_newly_cached():
            if self.store_policy == "prompt" and not is_prompt:
                continue
            if prefix_cache.lookup(block_hash) != block_id:
                continue  # no longer cached under that hash: nothing to store
            host_block = self.host.reserve(block_hash)
            if host_block is None:
                if not self.host.contains(block_hash):
                    self.stats.stores_skipped += 1  # every host block storing or pinned
                continue
            device.append(block_id)
            host.append(host_block)
            if self.events_on:
                self._store_meta[host_block] = (block_hash, parent, tokens)
        self._record_removed()
        if not device:
            return
        self.kv.hold_blocks(device)
        job = self.copier.store_blocks(device, host)
        self._stores.append(_Store(job, device, host))

    # ------------------------------------------------------------ events
    def take_events(self) -> list[KVCacheEvent]:
        """The host tier's KV-cache events since the last call, in order (empty when off)."""
        if not self._events:
            return []
        taken, self._events = self._events, []
        return taken

    def _record_stored(self, host_block: int) -> None:
        block_hash, parent, tokens = self._store_meta.pop(host_block)
        self._events.append(
            BlockStored(
                [external_block_hash(block_hash)],
                external_block_hash(parent) if parent is not None else None,
                list(tokens),
                self.kv.block_size,
                None,
                MEDIUM_CPU,
            )
        )

    def _record_removed(self) -> None:
        evicted = self.host.take_evicted()
        if evicted:
            self._events.append(BlockRemoved([external_block_hash(h) for h in evicted], MEDIUM_CPU))

    # ------------------------------------------------------------ queries
    @property
    def has_work(self) -> bool:
        """Copies in flight or queued, or newly cached blocks not yet offered to the host: the
        engine must keep stepping to finish them."""
        return bool(
            self._stores or self._swap_ins or self._new_swap_ins or self.kv.num_newly_cached
        )

    @property
    def num_swap_ins_in_flight(self) -> int:
        """Swap-ins whose copies have not been seen landed (queued ones included)."""
        return len(self._swap_ins) + len(self._new_swap_ins)

    @property
    def num_pending_store_blocks(self) -> int:
        """Blocks whose device-to-host copy has not been seen landed."""
        return sum(len(s.device_blocks) for s in self._stores)

    def held_block_tables(self) -> list[list[int]]:
        """Device blocks held by stores in flight (one reference each), for integrity checks."""
        return [s.device_blocks for s in self._stores]

    def get_stats(self) -> dict[str, float]:
        """Counters for ``LLMEngine.get_stats()`` (cumulative ones since start-up)."""
        return {
            "host_cache_hit_tokens": self.stats.hit_tokens,
            "swap_in_bytes": self.stats.swap_in_bytes,
            "swap_in_seconds": self.stats.swap_in_seconds,
            "host_store_bytes": self.stats.store_bytes,
            "host_store_skipped_blocks": self.stats.stores_skipped,
            "host_pending_stores": self.num_pending_store_blocks,
            "host_cache_usage": self.host.usage,
            "num_host_blocks": self.host.num_blocks,
        }

    def check_integrity(self) -> None:
        """The host cache's own check, plus: storing host blocks are exactly those of the stores
        in flight, and every pin belongs to a swap-in in flight.

        Raises:
            AssertionError: naming the broken invariant.
        """
        self.host.check_integrity()
        storing = sorted(b for s in self._stores for b in s.host_blocks)
        if storing != sorted(self.host.storing_blocks()):
            raise AssertionError(
                f"host blocks storing {sorted(self.host.storing_blocks())[:8]} != blocks of the "
                f"stores in flight {storing[:8]}"
            )
        pins = Counter(b for s in self._swap_ins + self._new_swap_ins for b in s.host_blocks)
        if dict(pins) != self.host.pin_counts():
            raise AssertionError("host pins differ from the host blocks of swap-ins in flight")
