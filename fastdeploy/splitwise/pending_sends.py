"""The prefill node's pending-send table: blocks held for a decode node until DONE, ABORT or lease
expiry (``docs/pd-disaggregation.md``, shared docs, "Block ownership").

Pure host bookkeeping, owned by the engine thread: the side channel hands CLAIM, HEARTBEAT, DONE
and ABORT to that thread, which calls these methods and frees what they return through the KV
cache manager. Times are ``time.monotonic()`` seconds.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PendingSend:
    """One finished ``do_remote_decode`` request whose blocks wait for the decode node.

    Attributes:
        request_id: the prefill node's request id (``remote_request_id``).
        block_ids: the request's block table (the blocks it holds a reference on).
        expires_at: when the entry is freed if nothing else happened.
        claimed: a decode node claimed it and may be reading now.
        held_since: when it was added (heartbeats never extend it past ``held_since +
            max_hold_s``).
        prompt_hash: the fingerprint of the prompt whose KV the blocks hold (CLAIM answers it).
    """

    request_id: str
    block_ids: list[int]
    expires_at: float
    claimed: bool = False
    held_since: float = 0.0
    prompt_hash: str | None = None


class PendingSends:
    """Blocks held for decode nodes.

    Args:
        lease_s: how long an unclaimed entry lives, and how long a heartbeat extends it.
        transfer_s: how long a claimed entry lives (the transfer deadline).
        max_hold_s: how far past its :meth:`add` heartbeats may extend an entry (None: without
            bound); a forged or runaway heartbeat cannot hold blocks longer.

    Raises:
        ValueError: a lease, transfer or hold time that is not > 0.
    """

    def __init__(self, lease_s: float, transfer_s: float, max_hold_s: float | None = None) -> None:
        for name, value in (
            ("pd_lease_s", lease_s),
            ("transfer_s", transfer_s),
            ("pd_max_hold_s", 1.0 if max_hold_s is None else max_hold_s),
        ):
            if not value > 0:
                raise ValueError(f"{name}={value!r} is invalid; allowed: seconds > 0")
        self.lease_s = lease_s
        self.transfer_s = transfer_s
        self.max_hold_s = max_hold_s
        self._entries: dict[str, PendingSend] = {}

    def add(
        self, request_id: str, block_ids: list[int], now: float, prompt_hash: str | None = None
    ) -> PendingSend:
        """Hold ``block_ids`` (the KV of the prompt fingerprinted ``prompt_hash``) for
        ``request_id`` until DONE, ABORT or ``now + lease_s``.

        Raises:
            ValueError: the request is already pending.
        """
        if request_id in self._entries:
            raise ValueError(f"request {request_id!r} is already pending a send")
        entry = PendingSend(
            request_id, list(block_ids), now + self.lease_s, held_since=now, prompt_hash=prompt_hash
        )
        self._entries[request_id] = entry
        return entry

    def claim(self, request_id: str, now: float) -> list[int]:
        """A decode node is about to read: mark the entry claimed (once), move its expiry to the
        transfer deadline; returns its blocks.

        Raises:
            KeyError: the entry is gone (expired, aborted, done, never existed) or already
                claimed; the decode node must not read then.
        """
        entry = self._live(request_id, now)
        if entry.claimed:
            raise KeyError(f"request {request_id!r} was already claimed")
        entry.claimed = True
        entry.expires_at = now + self.transfer_s
        return entry.block_ids

    def prompt_hash(self, request_id: str) -> str | None:
        """The prompt fingerprint an entry was held with (None when unknown or gone)."""
        entry = self._entries.get(request_id)
        return entry.prompt_hash if entry is not None else None

    def heartbeat(self, request_ids: list[str], now: float) -> list[str]:
        """Extend the leases of the entries still there, never past ``held_since +
        max_hold_s``; returns the ids that are gone."""
        gone = []
        for rid in request_ids:
            entry = self._entries.get(rid)
            if entry is None or entry.expires_at <= now:
                gone.append(rid)
                continue
            span = self.transfer_s if entry.claimed else self.lease_s
            until = now + span
            if self.max_hold_s is not None:
                until = min(until, entry.held_since + self.max_hold_s)
            entry.expires_at = max(entry.expires_at, until)
        return gone

    def release(self, request_id: str, unclaimed_only: bool = False) -> list[int] | None:
        """DONE or ABORT: drop the entry; returns its blocks to free, or None if it was gone.
        With ``unclaimed_only`` a claimed entry stays (a decode node may be reading it; it
        releases the entry itself)."""
        entry = self._entries.get(request_id)
        if entry is None or (unclaimed_only and entry.claimed):
            return None
        del self._entries[request_id]
        return entry.block_ids

    def sweep(self, now: float) -> list[PendingSend]:
        """Drop and return the expired entries (their blocks are to be freed)."""
        expired = [e for e in self._entries.values() if e.expires_at <= now]
        for entry in expired:
            del self._entries[entry.request_id]
        return expired

    def _live(self, request_id: str, now: float) -> PendingSend:
        entry = self._entries.get(request_id)
        if entry is None or entry.expires_at <= now:
            raise KeyError(f"request {request_id!r} is not pending a send (gone or expired)")
        return entry

    @property
    def num_blocks(self) -> int:
        """Block references held (for the integrity check and the metrics)."""
        return sum(len(e.block_ids) for e in self._entries.values())

    def claimed_blocks(self, now: float) -> set[int]:
        """The blocks of the claimed entries that have not expired (a decode node may read
        them now)."""
        return {
            b
            for e in self._entries.values()
            if e.claimed and e.expires_at > now
            for b in e.block_ids
        }

    def block_tables(self) -> list[list[int]]:
        """Each entry's block list (for the integrity check)."""
        return [list(e.block_ids) for e in self._entries.values()]

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._entries
