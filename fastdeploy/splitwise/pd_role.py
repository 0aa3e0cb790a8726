"""What the engine asks of its PD role: the :class:`PDRole` protocol, which both
:class:`~fastdeploy.splitwise.roles.PrefillRole` and :class:`~fastdeploy.splitwise.roles.DecodeRole`
implement in full (a call that belongs to the other role answers "nothing": no freed blocks, no
pull results, nothing in flight), so the engine never asks a role what it is.

A prefill node never gets a decode leg (admission refuses one), and a decode node never gets a
prefill leg: the calls that only such a leg leads to (:meth:`PDRole.hold` on a decode node,
:meth:`PDRole.start`, :meth:`PDRole.cancel` and :meth:`PDRole.abort_remote` on a prefill node)
raise ``RuntimeError``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from fastdeploy.splitwise.pd_auth import PrefillTrust
from fastdeploy.splitwise.protocol import RemotePrefill
from fastdeploy.splitwise.remote_kv_loader import PullResult


class PDRole(Protocol):
    """One node's side of prefill/decode disaggregation, owned by the engine thread.

    Attributes:
        trust: which prefill nodes a decode leg may name (checked at admission); None on a
            prefill node.
        failure_policy: ``kv_load_failure_policy``: what a failed pull does to its request
            (``"recompute"``: prefill here; else fail it).
    """

    trust: PrefillTrust | None
    failure_policy: str

    @property
    def has_pending(self) -> bool:
        """Blocks held for decode nodes, or released and not yet freed (prefill node)."""
        ...

    @property
    def in_flight(self) -> int:
        """Pulls started and not yet reported by :meth:`poll` (decode node)."""
        ...

    def set_wakeup(self, wakeup: Callable[[], None] | None) -> None:
        """Call ``wakeup()`` from another thread whenever background work ends (a pull)."""
        ...

    def held_block_tables(self) -> list[list[int]]:
        """The block lists held for decode nodes (for the integrity check)."""
        ...

    def hold(
        self,
        request_id: str,
        block_ids: list[int],
        num_prompt_tokens: int,
        first_token_id: int,
        first_token_logprobs: list[dict] | None = None,
        prompt_hash: str | None = None,
    ) -> dict[str, Any]:
        """Hold a finished prefill leg's blocks (the caller took a reference on each) for a
        decode node; returns the answer's ``kv_transfer_params``."""
        ...

    def take_freed(self) -> list[tuple[str, list[int], str]]:
        """``(request_id, block_ids, reason)`` of each held entry released since the last call;
        the engine drops its reference on each block."""
        ...

    def start(
        self, request_id: str, remote: RemotePrefill, block_ids: list[int], num_cached: int
    ) -> None:
        """Start pulling ``remote``'s blocks into ``block_ids``, skipping the leading blocks
        the prefix cache already had (``num_cached`` tokens)."""
        ...

    def cancel(self, request_id: str) -> None:
        """Stop a pull (its result arrives once it can write no more)."""
        ...

    def abort_remote(self, remote: RemotePrefill) -> None:
        """Tell the prefill node that its blocks are not needed."""
        ...

    def poll(self) -> list[PullResult]:
        """Pulls that ended since the last call."""
        ...

    def set_waiting(self, remotes: list[RemotePrefill]) -> None:
        """The decode legs still waiting for blocks (their prefill nodes' leases get
        heartbeats)."""
        ...

    def stats(self) -> dict[str, Any]:
        """Counters for metrics (``get_stats()["pd"]``)."""
        ...

    def close(self) -> None:
        """Stop the side channel, the transport and the role's threads."""
        ...
