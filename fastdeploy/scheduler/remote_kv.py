"""The scheduler's side of a PD decode node: requests in ``WAITING_FOR_REMOTE_KV`` (they hold
blocks for their whole prompt while its KV is pulled from the prefill node, and are never
scheduled), the pulls to start, and aborted ones whose blocks stay parked until their pull can
write no more. A mixin of :class:`~fastdeploy.scheduler.scheduler.Scheduler`, which owns the
queues these methods move requests between."""

from __future__ import annotations

import time

from fastdeploy.core.request import Request, RequestStatus


class RemoteKVMixin:
    """PD decode-node transitions of :class:`~fastdeploy.scheduler.scheduler.Scheduler`."""

    def take_new_remote_loads(self) -> list[Request]:
        """Requests that entered ``WAITING_FOR_REMOTE_KV`` since the last call (the engine
        starts their pulls)."""
        loads, self._new_remote_loads = self._new_remote_loads, []
        return [r for r in loads if r.status == RequestStatus.WAITING_FOR_REMOTE_KV]

    def remote_kv_loaded(self, request_id: str, first_token_id: int | None) -> Request | None:
        """The prompt's KV landed: the prompt counts as computed (its full blocks are cached),
        the prefill node's first token is appended, and the request runs from its next step.
        With ``first_token_id=None`` the last prompt token counts as not computed, so the next
        step recomputes it and samples the first token here. Returns the request, or None when
        it is no longer waiting (aborted meanwhile)."""
        request = self.waiting_for_remote_kv.pop(request_id, None)
        if request is None:
            return None
        request.num_computed_tokens = request.num_prompt_tokens - (first_token_id is None)
        self.kv_cache_manager.cache_full_blocks(request, request.num_computed_tokens)
        if first_token_id is not None:
            request.output_token_ids.append(first_token_id)
            request.first_token_time = time.monotonic()
        request.remote_prefill = None
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        return request

    def remote_kv_failed(self, request_id: str, recompute: bool) -> Request | None:
        """The pull failed. With ``recompute`` the request drops its blocks (none were cached)
        and goes to the front of the waiting queue as a local request (it prefills here);
        otherwise it stays out of every queue for the engine to finish. Returns the request, or
        None when it is no longer waiting."""
        request = self.waiting_for_remote_kv.pop(request_id, None)
        if request is None:
            return None
        if recompute:
            self.kv_cache_manager.free(request)
            request.num_computed_tokens = 0
            request.num_cached_tokens = 0
            request.remote_prefill = None
            request.status = RequestStatus.WAITING
            self.waiting.appendleft(request)
        else:
            self.running.append(request)  # so that finish_request() removes it as usual
            request.status = RequestStatus.RUNNING
        return request

    def release_cancelled(self, request_id: str) -> bool:
        """The pull of an aborted request ended: free its parked blocks. False if unknown."""
        request = self._cancelled_loads.pop(request_id, None)
        if request is None:
            return False
        self.kv_cache_manager.free(request)
        return True

    @property
    def num_cancelled_loads(self) -> int:
        """Aborted decode-leg requests whose blocks wait for their pull to end."""
        return len(self._cancelled_loads)
