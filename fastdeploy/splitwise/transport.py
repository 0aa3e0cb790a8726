"""What every KV transport shares: the :class:`Transfer` handle the engine polls, block runs, and
the protocol names (the choice itself is in :mod:`fastdeploy.splitwise.transport_select`).

A transport has one interface (``docs/pd-disaggregation.md``, shared docs): ``register(kv_caches)``
once, ``local_metadata()`` for ``kv_transfer_params``, ``start_pull(...) -> Transfer`` on the decode
node, and ``close()``. The engine never sees a transport library's types.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

PROTOCOLS = ("auto", "nixl", "tcp")


def start_pull_thread(
    pull: Callable[..., None],
    kv_caches: list[torch.Tensor],
    request_id: str,
    remote: dict,
    remote_block_ids: list[int],
    local_block_ids: list[int],
    timeout_s: float,
) -> Transfer:
    """The checks every transport's ``start_pull`` makes, then ``pull(transfer, remote,
    remote_ids, local_ids, timeout_s)`` on a new thread; returns the :class:`Transfer` it ends.

    Raises:
        ValueError: the two id lists differ in length, or no KV cache is registered.
    """
    if len(remote_block_ids) != len(local_block_ids):
        raise ValueError(
            f"{len(remote_block_ids)} remote blocks for {len(local_block_ids)} local blocks"
        )
    if not kv_caches:
        raise ValueError("register the KV caches before pulling")
    transfer = Transfer(request_id)
    threading.Thread(
        target=pull,
        args=(transfer, remote, list(remote_block_ids), list(local_block_ids), timeout_s),
        name=f"kv-pull-{request_id}",
        daemon=True,
    ).start()
    return transfer


def block_bytes(kv_cache: torch.Tensor) -> int:
    """Bytes of one block of one layer (``kv_cache`` is ``[num_blocks, ...]``)."""
    return kv_cache[0].numel() * kv_cache.element_size()


@dataclass
class Transfer:
    """One pull in flight (the engine polls it from its own thread).

    Attributes:
        request_id: the decode-side request it fills.
        num_bytes: bytes received so far.
        seconds: wall time of the pull once done.
        error: why it failed, or None.
    """

    request_id: str
    num_bytes: int = 0
    seconds: float = 0.0
    error: str | None = None
    _done: threading.Event = field(default_factory=threading.Event, repr=False)
    _cancelled: bool = field(default=False, repr=False)
    #: What the transport does to stop a pull in flight (close a socket, release a handle).
    _cancel_hook: Callable[[], None] | None = field(default=None, repr=False)

    def done(self) -> bool:
        """The pull ended (check :attr:`error`). Until then it may still write blocks."""
        return self._done.is_set()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until done (or ``timeout_s``); returns :meth:`done`."""
        return self._done.wait(timeout_s)

    def cancel(self) -> None:
        """Stop the pull; it ends with an error soon after. The decode node frees the blocks
        only once :meth:`done` is true, so no late write can land in a reused block."""
        self._cancelled = True
        hook = self._cancel_hook
        if hook is not None:
            hook()

    def finish(self, error: str | None, seconds: float) -> None:
        """Called by the transport once, when the pull has ended and can write no more."""
        self.error = "cancelled" if self._cancelled and error else error
        self.seconds = seconds
        self._cancel_hook = None
        self._done.set()
