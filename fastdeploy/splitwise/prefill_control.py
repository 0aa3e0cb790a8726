"""The prefill node's side of the control channel: CLAIM, HEARTBEAT, DONE and ABORT against the
pending-send table, answered from the side channel's threads.

The table is shared under a lock. Nothing here frees a block: DONE, ABORT and lease expiry move
block lists to a queue that the engine thread drains (:meth:`PrefillControl.take_freed`) and frees
through its KV cache manager, which only that thread touches. So a CLAIM is answered at once, even
while the engine thread is inside a step.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from fastdeploy.splitwise.pending_sends import PendingSends


class PrefillControl:
    """Thread-safe pending sends of one prefill engine.

    Args:
        lease_s: ``--pd-lease-s``: how long blocks wait for an unclaimed transfer.
        transfer_s: how long a claimed transfer may take.
        clock: ``time.monotonic`` (tests pass their own).
        max_hold_s: ``--pd-max-hold-s``: heartbeats never hold an entry longer (None: no bound).
    """

    def __init__(
        self,
        lease_s: float,
        transfer_s: float,
        clock: Callable[[], float] = time.monotonic,
        max_hold_s: float | None = None,
    ) -> None:
        self._table = PendingSends(lease_s, transfer_s, max_hold_s)
        self._lock = threading.Lock()
        self._freed: list[tuple[str, list[int], str]] = []
        self._clock = clock
        self.counts = {"claims": 0, "done": 0, "aborts": 0, "expired": 0}

    # ------------------------------------------------------------ engine thread
    def hold(self, request_id: str, block_ids: list[int], prompt_hash: str | None = None) -> None:
        """A prefill-leg request finished: hold its blocks (the KV of the prompt fingerprinted
        ``prompt_hash``) for the decode node (the engine keeps its references on them until
        :meth:`take_freed` hands them back)."""
        with self._lock:
            self._table.add(request_id, block_ids, self._clock(), prompt_hash)

    def take_freed(self) -> list[tuple[str, list[int], str]]:
        """Expire old entries, then return every ``(request_id, block_ids, reason)`` to free now
        (reason ``done``, ``abort`` or ``expired``)."""
        with self._lock:
            for entry in self._table.sweep(self._clock()):
                self._freed.append((entry.request_id, entry.block_ids, "expired"))
                self.counts["expired"] += 1
            freed, self._freed = self._freed, []
        return freed

    @property
    def num_pending_blocks(self) -> int:
        """Block references held for decode nodes (the integrity check counts them)."""
        with self._lock:
            return self._table.num_blocks

    def block_tables(self) -> list[list[int]]:
        """The block list of every pending entry (for the integrity check)."""
        with self._lock:
            return self._table.block_tables()

    @property
    def has_work(self) -> bool:
        """Entries pending, or released ones the engine thread has not freed yet."""
        with self._lock:
            return bool(len(self._table) or self._freed)

    @property
    def num_pending(self) -> int:
        with self._lock:
            return len(self._table)

    # ------------------------------------------------------------ transport threads
    def readable(self, block_ids: list[int]) -> bool:
        """Whether every block of ``block_ids`` belongs to a live, claimed pending send: the only
        blocks the ``tcp`` transport serves (its ``authorize`` hook)."""
        now = self._clock()
        with self._lock:
            allowed = self._table.claimed_blocks(now)
        return set(block_ids) <= allowed

    # ------------------------------------------------------------ side channel threads
    def handle(self, op: str, message: dict[str, Any]) -> dict[str, Any]:
        """The handler of :class:`fastdeploy.splitwise.side_channel.SideChannelServer`.

        CLAIM answers the entries' blocks and prompt fingerprints; ABORT with
        ``"unclaimed_only": true`` leaves claimed entries alone.

        Raises:
            KeyError: CLAIM of an entry that is gone, expired or already claimed (the decode node
                must not read then); the side channel answers ``ok: false``.
        """
        ids = message["request_ids"]
        now = self._clock()
        with self._lock:
            if op == "CLAIM":
                # The decode node reads only these blocks, and only if this fingerprint is its
                # prompt's: the client's copy of both could be edited, this answer cannot.
                blocks = {rid: self._table.claim(rid, now) for rid in ids}
                self.counts["claims"] += len(ids)
                hashes = {rid: self._table.prompt_hash(rid) for rid in ids}
                return {"block_ids": blocks, "prompt_hashes": hashes}
            if op == "HEARTBEAT":
                return {"gone": self._table.heartbeat(ids, now)}
            reason = "done" if op == "DONE" else "abort"
            # A refused decode leg's ABORT (a decode node's or a router's) must not free blocks
            # that another decode leg with the same params has claimed and may be reading.
            unclaimed_only = message.get("unclaimed_only") is True
            for rid in ids:
                blocks = self._table.release(rid, unclaimed_only)
                if blocks is not None:
                    self._freed.append((rid, blocks, reason))
                    self.counts["done" if op == "DONE" else "aborts"] += 1
            return {}
