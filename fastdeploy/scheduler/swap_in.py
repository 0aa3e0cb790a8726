"""The scheduler's swap-in queue (host KV tier): requests in ``WAITING_FOR_SWAP_IN`` hold their
device blocks while their host hits are copied in, and are never scheduled; aborted ones keep
their blocks parked until the copy landed. The :class:`~fastdeploy.scheduler.scheduler.Scheduler`
owns one (empty without a host tier) and moves requests between it and its running queue."""

from __future__ import annotations

from fastdeploy.cache_manager.host_tier import HostTier
from fastdeploy.cache_manager.kv_cache_manager import KVCacheManager
from fastdeploy.core.request import Request, RequestStatus


class SwapInQueue:
    """Requests whose host-tier hits are being copied back to the device.

    Args:
        kv_cache_manager: the scheduler's.
        host_tier: the host KV tier over ``kv_cache_manager``, or None (no host hits, ever).

    Attributes:
        waiting: request id -> request, every one in ``WAITING_FOR_SWAP_IN``.
    """

    def __init__(self, kv_cache_manager: KVCacheManager, host_tier: HostTier | None) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.host_tier = host_tier
        self.waiting: dict[str, Request] = {}
        self._cancelled: set[Request] = set()  # aborted; blocks parked until the copy landed

    def __len__(self) -> int:
        return len(self.waiting)

    def lookup(self, request: Request) -> list[int]:
        """The host blocks that continue ``request``'s device prefix hit (none without a host
        tier)."""
        return self.host_tier.lookup(request) if self.host_tier is not None else []

    def start(self, request: Request, host_hits: list[int]) -> bool:
        """Swap the host hits into the blocks that follow the device hits; they count as
        computed (and cached) tokens. Returns True when the request must wait for the copy
        (``swap_in_mode=request``; it is then in ``WAITING_FOR_SWAP_IN``), False when it runs
        in this step (``layerwise``)."""
        block_size = self.kv_cache_manager.block_size
        first = request.num_computed_tokens // block_size
        device = request.block_ids[first : first + len(host_hits)]
        self.host_tier.start_swap_in(request, host_hits, device)
        host_tokens = len(host_hits) * block_size
        request.num_computed_tokens += host_tokens
        request.num_cached_tokens += host_tokens
        if self.host_tier.layerwise:
            return False
        request.status = RequestStatus.WAITING_FOR_SWAP_IN
        self.waiting[request.request_id] = request
        return True

    def landed(self, request: Request) -> bool:
        """The copies into ``request``'s blocks landed. Returns True when it waited for them: it
        is RUNNING now (the swapped-in blocks enter the device prefix cache; the caller queues
        it). One aborted meanwhile frees its parked blocks now; for any other (``layerwise``:
        already running or finished) nothing changes. False in both cases."""
        if request in self._cancelled:
            self._cancelled.discard(request)
            self.kv_cache_manager.free(request)
            return False
        if self.waiting.get(request.request_id) is not request:
            return False
        del self.waiting[request.request_id]
        self.kv_cache_manager.cache_full_blocks(request, request.num_computed_tokens)
        request.status = RequestStatus.RUNNING
        return True

    def cancel(self, request: Request) -> None:
        """An aborted waiting request: park its blocks until its copy landed."""
        del self.waiting[request.request_id]
        self._cancelled.add(request)

    @property
    def num_cancelled(self) -> int:
        """Aborted requests whose blocks wait for their swap-in to land."""
        return len(self._cancelled)

    def block_tables(self) -> list[list[int]]:
        """The block lists this queue holds, waiting and parked (for the integrity check)."""
        held = [r.block_ids for r in self.waiting.values()]
        return held + [r.block_ids for r in self._cancelled]
