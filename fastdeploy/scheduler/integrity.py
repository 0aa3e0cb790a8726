"""The scheduler's integrity check: every KV block in use has exactly one holder, and each queue
holds requests in the state it stands for. A mixin of :class:`~fastdeploy.scheduler.scheduler.
Scheduler`, whose queues it reads; tests call it after every step."""

from __future__ import annotations

from fastdeploy.core.request import RequestStatus


class IntegrityMixin:
    """:meth:`check_integrity` of :class:`~fastdeploy.scheduler.scheduler.Scheduler`."""

    def check_integrity(self, other_holders: list[list[int]] | None = None) -> None:
        """Check the KV cache manager, and that running requests, requests waiting for remote KV,
        parked cancelled loads and ``other_holders`` (a prefill node's pending sends) hold
        exactly the used blocks that the prefix cache does not; waiting requests hold none.

        Raises:
            AssertionError: naming the first broken invariant.
        """
        held = [r.block_ids for r in self.running]
        held += [r.block_ids for r in self.waiting_for_remote_kv.values()]
        held += [r.block_ids for r in self._cancelled_loads.values()]
        held += [r.block_ids for r in self.waiting_for_swap_in.values()]
        held += [r.block_ids for r in self._cancelled_swap_ins]
        self.kv_cache_manager.check_integrity(held + list(other_holders or []))
        if len(self.running) > self.max_num_seqs:
            raise AssertionError(f"{len(self.running)} running > max_num_seqs={self.max_num_seqs}")
        for r in self.waiting:
            if r.block_ids or r.num_computed_tokens or r.status != RequestStatus.WAITING:
                raise AssertionError(f"waiting request {r.request_id!r} holds blocks or tokens")
        block_size = self.kv_cache_manager.block_size
        for r in self.running:
            if r.status != RequestStatus.RUNNING:
                raise AssertionError(f"running request {r.request_id!r} has status {r.status}")
            if len(r.block_ids) * block_size < r.num_computed_tokens:
                raise AssertionError(f"request {r.request_id!r}: blocks do not cover its KV")
        for r in self.waiting_for_remote_kv.values():
            if r.status != RequestStatus.WAITING_FOR_REMOTE_KV:
                raise AssertionError(f"request {r.request_id!r} waits for KV with {r.status}")
            if len(r.block_ids) * block_size < r.num_prompt_tokens:
                raise AssertionError(f"request {r.request_id!r}: blocks do not cover its prompt")
        for r in self.waiting_for_swap_in.values():
            if r.status != RequestStatus.WAITING_FOR_SWAP_IN:
                raise AssertionError(f"request {r.request_id!r} waits for swap-in with {r.status}")
            if len(r.block_ids) * block_size < r.num_computed_tokens:
                raise AssertionError(f"request {r.request_id!r}: blocks do not cover its KV")
        ids = [r.request_id for r in self.running] + [r.request_id for r in self.waiting]
        ids += list(self.waiting_for_remote_kv) + list(self.waiting_for_swap_in)
        if len(set(ids)) != len(ids) or set(ids) != set(self._requests):
            raise AssertionError("waiting + running differ from the known unfinished requests")
