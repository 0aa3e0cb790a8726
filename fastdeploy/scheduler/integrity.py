"""The scheduler's integrity check: every KV block in use has exactly one holder, and each queue
holds requests in the state it stands for. Tests call it after every step (through
:meth:`~fastdeploy.scheduler.scheduler.Scheduler.check_integrity`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastdeploy.core.request import RequestStatus

if TYPE_CHECKING:
    from fastdeploy.scheduler.scheduler import Scheduler


def check_integrity(scheduler: Scheduler, other_holders: list[list[int]] | None = None) -> None:
    """Check ``scheduler``'s KV cache manager, and that running requests, requests waiting for
    remote KV or a swap-in (parked aborted ones included) and ``other_holders`` (a prefill
    node's pending sends, the host tier's copies) hold exactly the used blocks that the prefix
    cache does not; waiting requests hold none.

    Raises:
        AssertionError: naming the first broken invariant.
    """
    s = scheduler
    held = [r.block_ids for r in s.running]
    held += s.remote_kv.block_tables() + s.swap_in.block_tables()
    s.kv_cache_manager.check_integrity(held + list(other_holders or []))
    if len(s.running) > s.max_num_seqs:
        raise AssertionError(f"{len(s.running)} running > max_num_seqs={s.max_num_seqs}")
    for r in s.waiting:
        if r.block_ids or r.num_computed_tokens or r.status != RequestStatus.WAITING:
            raise AssertionError(f"waiting request {r.request_id!r} holds blocks or tokens")
    block_size = s.kv_cache_manager.block_size
    for r in s.running:
        if r.status != RequestStatus.RUNNING:
            raise AssertionError(f"running request {r.request_id!r} has status {r.status}")
        if len(r.block_ids) * block_size < r.num_computed_tokens:
            raise AssertionError(f"request {r.request_id!r}: blocks do not cover its KV")
    for r in s.remote_kv.waiting.values():
        if r.status != RequestStatus.WAITING_FOR_REMOTE_KV:
            raise AssertionError(f"request {r.request_id!r} waits for KV with {r.status}")
        if len(r.block_ids) * block_size < r.num_prompt_tokens:
            raise AssertionError(f"request {r.request_id!r}: blocks do not cover its prompt")
    for r in s.swap_in.waiting.values():
        if r.status != RequestStatus.WAITING_FOR_SWAP_IN:
            raise AssertionError(f"request {r.request_id!r} waits for swap-in with {r.status}")
        if len(r.block_ids) * block_size < r.num_computed_tokens:
            raise AssertionError(f"request {r.request_id!r}: blocks do not cover its KV")
    ids = [r.request_id for r in s.running] + [r.request_id for r in s.waiting]
    ids += list(s.remote_kv.waiting) + list(s.swap_in.waiting)
    if len(set(ids)) != len(ids) or set(ids) != set(s.request_ids):
        raise AssertionError("waiting + running differ from the known unfinished requests")
