"""The decode node's transfer thread: CLAIM, pull, DONE, for requests in ``WAITING_FOR_REMOTE_KV``.

The engine thread submits a :class:`PullJob` once the request holds its local blocks, and polls
:meth:`RemoteKVLoader.poll` every step for finished jobs; it never waits on the network. A job:

1. CLAIMs the prefill node's blocks over the side channel (a GONE answer fails the job: the blocks
   may already be freed and reused, so they must not be read);
2. checks that the prefill node holds the blocks and the prompt (its fingerprint) that
   ``kv_transfer_params`` name, then pulls only the blocks this node's prefix cache lacks
   (``skip_blocks`` at the front) through the transport, from where the CLAIM answer says
   the blocks are (a prefill node names its own transport; the ``transport`` of
   ``kv_transfer_params`` is only the fallback of a peer that does not);
3. sends DONE (the prefill node frees its blocks), or ABORT when the pull failed.

The job's ``timeout_s`` is one deadline for all three: each step gets what is left of it, so a
stalled (not dead) peer's failure is reported at the deadline plus at most
:data:`TRAILER_FLOOR_S`.

A cancelled job (the client went away) reports only once its pull can write no more, so the engine
frees the local blocks after any late write. Byte and time counts feed the metrics.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from fastdeploy.splitwise.protocol import RemotePrefill
from fastdeploy.splitwise.side_channel import SideChannelError, send_control
from fastdeploy.splitwise.transport import Transfer

logger = logging.getLogger(__name__)

#: Seconds a DONE or ABORT may take once the job's deadline has passed (a failed pull still
#: tells the prefill node, but a stalled one holds the result back by at most this much).
TRAILER_FLOOR_S = 0.25


@dataclass(frozen=True)
class PullJob:
    """One decode request's KV to fetch.

    Attributes:
        request_id: the decode node's request id.
        remote: what the prefill node answered.
        local_block_ids: this node's block table for the prompt (same length as
            ``remote.remote_block_ids``).
        skip_blocks: leading blocks this node already has (its own prefix cache hit).
        timeout_s: limit of the whole job (claim, pull, done).
    """

    request_id: str
    remote: RemotePrefill
    local_block_ids: list[int]
    skip_blocks: int
    timeout_s: float


@dataclass(frozen=True)
class PullResult:
    """A finished job: ``error`` is None on success, else why it failed (``claim``, ``transfer``,
    ``cancelled`` first, then details)."""

    request_id: str
    error: str | None
    num_bytes: int
    seconds: float


class RemoteKVLoader:
    """Runs pull jobs on background threads.

    Args:
        transport: a registered KV transport (``tcp`` or ``nixl``).
        control_timeout_s: limit of one side channel message.
        auth: signs the side channel messages (None: the process's PD secret, if any).
    """

    def __init__(self, transport, control_timeout_s: float = 5.0, auth=None) -> None:
        self.transport = transport
        self.control_timeout_s = control_timeout_s
        self.auth = auth
        self._results: queue.SimpleQueue[PullResult] = queue.SimpleQueue()
        self._cancelled: set[str] = set()
        self._transfers: dict[str, Transfer] = {}
        self._lock = threading.Lock()
        self.in_flight = 0
        #: Called (from a transfer thread) after each result is queued, to wake the engine loop.
        self.on_result: Callable[[], None] | None = None

    def submit(self, job: PullJob) -> None:
        """Start ``job`` (engine thread).

        Raises:
            ValueError: the local and remote block tables differ in length, or ``skip_blocks``
                is outside them.
        """
        n = len(job.remote.remote_block_ids)
        if len(job.local_block_ids) != n or not 0 <= job.skip_blocks <= n:
            raise ValueError(
                f"request {job.request_id!r}: {len(job.local_block_ids)} local blocks and "
                f"skip_blocks={job.skip_blocks} for {n} remote blocks"
            )
        with self._lock:
            self.in_flight += 1
        threading.Thread(
            target=self._run, args=(job,), name=f"pd-pull-{job.request_id}", daemon=True
        ).start()

    def cancel(self, request_id: str) -> None:
        """Stop a job; its result (``cancelled``) arrives once nothing can write any more."""
        with self._lock:
            self._cancelled.add(request_id)
            transfer = self._transfers.get(request_id)
        if transfer is not None:
            transfer.cancel()

    def poll(self) -> list[PullResult]:
        """Finished jobs since the last call (engine thread; never blocks)."""
        results = []
        while True:
            try:
                results.append(self._results.get_nowait())
            except queue.Empty:
                return results

    def _control(self, op: str, job: PullJob, timeout_s: float) -> dict:
        r = job.remote
        extra = {} if self.auth is None else {"auth": self.auth}
        return send_control(
            r.remote_host, r.remote_port, op, [r.remote_request_id], timeout_s, **extra
        )

    def _tell_quietly(self, op: str, job: PullJob, deadline: float) -> None:
        """DONE or ABORT, best effort, within what is left of the deadline (at least
        :data:`TRAILER_FLOOR_S`): the prefill node frees a claimed entry at its own transfer
        deadline anyway, so a stalled peer never holds the result back."""
        left = max(deadline - time.monotonic(), TRAILER_FLOOR_S)
        try:
            self._control(op, job, min(self.control_timeout_s, left))
        except SideChannelError as e:
            logger.warning("request %s: %s", job.request_id, e)

    def _run(self, job: PullJob) -> None:
        start = time.monotonic()
        deadline = start + job.timeout_s
        error, num_bytes = "transfer: the pull thread failed", 0
        try:
            error, num_bytes = self._claim_and_pull(job, deadline)
        except Exception as e:  # noqa: BLE001 - never report an unfinished pull as a success
            logger.exception("request %s: pull failed", job.request_id)
            error = f"transfer: {type(e).__name__}: {e}"
        finally:
            with self._lock:
                self._transfers.pop(job.request_id, None)
                self._cancelled.discard(job.request_id)
                self.in_flight -= 1
            self._results.put(
                PullResult(job.request_id, error, num_bytes, time.monotonic() - start)
            )
            wake = self.on_result
            if wake is not None:
                wake()

    def _claim_and_pull(self, job: PullJob, deadline: float) -> tuple[str | None, int]:
        """CLAIM, pull and DONE (or ABORT) within ``deadline`` (``time.monotonic()``): every
        step gets only what is left of it, so a stalled peer's failure is reported at the
        deadline, not at the sum of the steps' own limits."""
        if job.skip_blocks == len(job.local_block_ids):  # all cached here: nothing to read
            self._tell_quietly("DONE", job, deadline)
            return None, 0
        left = deadline - time.monotonic()
        if left <= 0:
            return f"transfer: no time left of the {job.timeout_s:g} s deadline to CLAIM", 0
        try:
            reply = self._control("CLAIM", job, min(self.control_timeout_s, left))
        except SideChannelError as e:
            if isinstance(e.__cause__, TimeoutError):
                # A stalled peer may still serve this CLAIM once it resumes: queue an ABORT
                # behind it, so that it frees the blocks then rather than at its own deadline.
                self._tell_quietly("ABORT", job, deadline)
            return f"claim: {e}", 0
        remote = job.remote
        skip = job.skip_blocks
        # Read the blocks the prefill node says it holds for this request, never the ids the
        # client passed along (a forged list could read, and cache, other requests' KV); and
        # only if they hold this prompt (the decode node checked kv_transfer_params' copy of the
        # fingerprint against its prompt at admission; this is the prefill node's own).
        claimed = (reply.get("block_ids") or {}).get(remote.remote_request_id)
        if claimed != list(remote.remote_block_ids):
            self._tell_quietly("ABORT", job, deadline)
            return "claim: the prefill node holds other blocks than kv_transfer_params names", 0
        held_hash = (reply.get("prompt_hashes") or {}).get(remote.remote_request_id)
        if held_hash != remote.prompt_hash:
            self._tell_quietly("ABORT", job, deadline)
            return (
                f"claim: the prefill node holds the KV of another prompt (prompt_hash "
                f"{held_hash!r}, this request's is {remote.prompt_hash!r})",
                0,
            )
        try:
            with self._lock:
                if job.request_id in self._cancelled:
                    transfer = None
                else:
                    transfer = self.transport.start_pull(
                        job.request_id,
                        reply.get("transport") or remote.transport,
                        claimed[skip:],
                        job.local_block_ids[skip:],
                        max(deadline - time.monotonic(), 0.001),
                    )
                    self._transfers[job.request_id] = transfer
        except Exception as e:  # noqa: BLE001 - bad transport metadata: fail this pull only
            self._tell_quietly("ABORT", job, deadline)
            return (
                f"transfer: cannot start ({type(e).__name__}: {e}; do both nodes use the same "
                "--cache-transfer-protocol?)",
                0,
            )
        if transfer is None:
            error = "cancelled"
        else:
            error = self._wait(job, transfer, deadline)
        self._tell_quietly("ABORT" if error else "DONE", job, deadline)
        return error, (transfer.num_bytes if transfer is not None else 0)

    def _wait(self, job: PullJob, transfer: Transfer, deadline: float) -> str | None:
        """Wait for ``transfer`` until ``deadline``, then cancel it (a transport that missed its
        own limit, e.g. a peer trickling bytes) and wait until it can write no more; returns
        the job's error or None."""
        if not transfer.wait(max(deadline - time.monotonic(), 0.0)):
            transfer.cancel()
            transfer.wait()
            if transfer.error is not None and job.request_id not in self._cancelled:
                return f"transfer: the pull did not finish within its {job.timeout_s:g} s deadline"
        if transfer.error == "cancelled":
            return "cancelled"
        return None if transfer.error is None else f"transfer: {transfer.error}"
