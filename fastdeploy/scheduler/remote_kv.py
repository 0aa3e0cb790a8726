"""The scheduler's remote-KV queue (PD decode node): requests in ``WAITING_FOR_REMOTE_KV`` hold
blocks for their whole prompt while its KV is pulled from the prefill node, and are never
scheduled; the queue also lists the pulls to start, and parks the blocks of aborted ones until
their pull can write no more. The :class:`~fastdeploy.scheduler.scheduler.Scheduler` owns one and
moves requests between it and its running and waiting queues."""

from __future__ import annotations

import time

from fastdeploy.cache_manager.kv_cache_manager import KVCacheManager
from fastdeploy.core.request import Request, RequestStatus


class RemoteKVQueue:
    """Decode-leg requests whose prompt KV is being pulled.

    Args:
        kv_cache_manager: the scheduler's; blocks of landed pulls are cached in it, blocks of
            failed or cancelled ones freed.

    Attributes:
        waiting: request id -> request, every one in ``WAITING_FOR_REMOTE_KV``.
    """

    def __init__(self, kv_cache_manager: KVCacheManager) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.waiting: dict[str, Request] = {}
        self._new: list[Request] = []  # entered since the last take_new()
        self._cancelled: dict[str, Request] = {}  # aborted; blocks parked until the pull ends

    def __len__(self) -> int:
        return len(self.waiting)

    def admit(self, request: Request) -> None:
        """``request`` got blocks for its whole prompt: it waits for its pull."""
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.waiting[request.request_id] = request
        self._new.append(request)

    def take_new(self) -> list[Request]:
        """Requests that entered ``WAITING_FOR_REMOTE_KV`` since the last call (the engine
        starts their pulls)."""
        loads, self._new = self._new, []
        return [r for r in loads if r.status == RequestStatus.WAITING_FOR_REMOTE_KV]

    def loaded(self, request_id: str, first_token_id: int | None) -> Request | None:
        """The prompt's KV landed: the prompt counts as computed (its full blocks are cached)
        and the prefill node's first token is appended; the request is RUNNING (the caller
        queues it). With ``first_token_id=None`` the last prompt token counts as not computed.
        Returns the request, or None when it is no longer waiting (aborted meanwhile)."""
        request = self.waiting.pop(request_id, None)
        if request is None:
            return None
        request.num_computed_tokens = request.num_prompt_tokens - (first_token_id is None)
        self.kv_cache_manager.cache_full_blocks(request, request.num_computed_tokens)
        if first_token_id is not None:
            request.output_token_ids.append(first_token_id)
            request.first_token_time = time.monotonic()
        request.remote_prefill = None
        request.status = RequestStatus.RUNNING
        return request

    def failed(self, request_id: str, recompute: bool) -> Request | None:
        """The pull failed. With ``recompute`` the request drops its blocks (none were cached)
        and becomes a WAITING local request; otherwise it is RUNNING for the engine to finish
        (the caller queues it either way). Returns the request, or None when it is no longer
        waiting."""
        request = self.waiting.pop(request_id, None)
        if request is None:
            return None
        if recompute:
            self.kv_cache_manager.free(request)
            request.num_computed_tokens = 0
            request.num_cached_tokens = 0
            request.remote_prefill = None
            request.status = RequestStatus.WAITING
        else:
            request.status = RequestStatus.RUNNING
        return request

    def cancel(self, request: Request) -> None:
        """An aborted waiting request: park its blocks until :meth:`release_cancelled` (a pull
        may still write them)."""
        del self.waiting[request.request_id]
        self._cancelled[request.request_id] = request

    def is_cancelled(self, request_id: str) -> bool:
        """Whether an aborted request with this id still waits for its pull to stop."""
        return request_id in self._cancelled

    def release_cancelled(self, request_id: str) -> bool:
        """The pull of an aborted request ended: free its parked blocks. False if unknown."""
        request = self._cancelled.pop(request_id, None)
        if request is None:
            return False
        self.kv_cache_manager.free(request)
        return True

    @property
    def num_cancelled(self) -> int:
        """Aborted decode-leg requests whose blocks wait for their pull to end."""
        return len(self._cancelled)

    def block_tables(self) -> list[list[int]]:
        """The block lists this queue holds, waiting and parked (for the integrity check)."""
        held = [r.block_ids for r in self.waiting.values()]
        return held + [r.block_ids for r in self._cancelled.values()]
