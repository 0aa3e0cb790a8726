"""The scheduler's side of the host KV tier: requests in ``WAITING_FOR_SWAP_IN`` (they hold their
device blocks while host hits are copied in, and are never scheduled), and aborted ones whose
blocks stay parked until the copy landed. A mixin of :class:`~fastdeploy.scheduler.scheduler.
Scheduler`, which owns the queues these methods move requests between."""

from __future__ import annotations

from fastdeploy.core.request import Request, RequestStatus


class SwapInMixin:
    """Swap-in transitions of :class:`~fastdeploy.scheduler.scheduler.Scheduler`."""

    def swap_in_landed(self, request: Request) -> None:
        """The host-tier copies into ``request``'s blocks landed. A request waiting for them
        runs from its next step (the swapped-in blocks enter the device prefix cache); one
        aborted meanwhile frees its parked blocks now; for any other (``layerwise``: already
        running or finished) nothing changes."""
        if request in self._cancelled_swap_ins:
            self._cancelled_swap_ins.discard(request)
            self.kv_cache_manager.free(request)
            return
        if self.waiting_for_swap_in.get(request.request_id) is not request:
            return
        del self.waiting_for_swap_in[request.request_id]
        self.kv_cache_manager.cache_full_blocks(request, request.num_computed_tokens)
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    @property
    def num_cancelled_swap_ins(self) -> int:
        """Aborted requests whose blocks wait for their swap-in to land."""
        return len(self._cancelled_swap_ins)
