"""The engine's side of prefill/decode disaggregation: one object per role, owned by the engine
thread (``docs/pd-disaggregation.md``, shared docs).

* :class:`PrefillRole`: a finished prefill-leg request's blocks move to the pending-send table
  (one more reference each) and its answer carries ``kv_transfer_params``; the side channel
  answers CLAIM/HEARTBEAT/DONE/ABORT from its own threads, and the engine thread frees what they
  released (:meth:`PrefillRole.take_freed`).
* :class:`DecodeRole`: starts a pull per request that entered ``WAITING_FOR_REMOTE_KV``, reports
  finished pulls, and heartbeats the prefill nodes of requests still waiting for blocks so their
  leases do not run out.

Both implement :class:`~fastdeploy.splitwise.pd_role.PDRole`, the engine's one view of them.
The transport (``tcp`` or ``nixl``) is registered once with the KV caches; the engine never sees
its types. With a PD secret (``--pd-secret-file`` or ``FD_PD_SECRET``) both roles sign what they
send and refuse what is not signed (:mod:`~fastdeploy.splitwise.pd_auth`); without one they warn
at start.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable
from typing import Any

from fastdeploy.config import FDConfig
from fastdeploy.splitwise.legs import (  # noqa: F401 - re-exported: the admission checks' old home
    check_decode_leg,
    check_first_token_logprobs,
    check_kv_transfer_params,
    release_refused_leg,
    send_abort,
)
from fastdeploy.splitwise.pd_auth import PDAuth, PrefillTrust, is_loopback, set_process_auth
from fastdeploy.splitwise.pd_role import PDRole
from fastdeploy.splitwise.prefill_control import PrefillControl
from fastdeploy.splitwise.protocol import RemotePrefill
from fastdeploy.splitwise.remote_kv_loader import PullJob, PullResult, RemoteKVLoader
from fastdeploy.splitwise.side_channel import SideChannelError, SideChannelServer, send_control
from fastdeploy.splitwise.transport_select import make_transport

logger = logging.getLogger(__name__)


class _Role:
    """What both roles share: the transport, the side channel and counters."""

    #: Which prefill nodes decode legs may name (a decode node's; checked at admission).
    trust: PrefillTrust | None = None

    def __init__(
        self,
        config: FDConfig,
        kv_caches: list,
        layout: dict[str, Any],
        handler: Callable[[str, dict], dict],
    ) -> None:
        sw = config.splitwise_config
        self.config = sw
        self.layout = layout
        self.failure_policy = sw.kv_load_failure_policy
        self.engine_id = f"{config.parallel_config.splitwise_role}-{uuid.uuid4().hex[:12]}"
        self.auth = PDAuth.from_secret_file(sw.pd_secret_file)
        set_process_auth(self.auth)  # every send_control of this process signs with it
        if self.auth is None:
            logger.warning(
                "PD is unauthenticated: no --pd-secret-file or FD_PD_SECRET, so anyone who can "
                "reach %s can send control messages and read claimed KV blocks%s",
                sw.pd_host,
                "" if is_loopback(sw.pd_host) else " (--pd-host is not a loopback address)",
            )
        self.transport = make_transport(
            sw.cache_transfer_protocol,
            sw.pd_host,
            self.engine_id,
            auth=self.auth,
            max_connections=sw.pd_max_connections,
        )
        self.transport.register(kv_caches)
        self.side_channel = SideChannelServer(
            sw.pd_host, sw.pd_comm_port or 0, handler, self.auth, sw.pd_max_connections
        ).start()
        logger.info(
            "PD %s node %s: side channel on %s:%d, KV transport %s",
            config.parallel_config.splitwise_role,
            self.engine_id,
            sw.pd_host,
            self.side_channel.port,
            self.transport.name,
        )

    def security_stats(self) -> dict[str, Any]:
        """Refused PD messages by reason, and connections refused over the cap, by listener."""
        return {
            "auth_rejected": dict(self.auth.rejected) if self.auth is not None else {},
            "connections_refused": {
                "side_channel": self.side_channel.refused_connections,
                "kv": getattr(self.transport, "refused_connections", 0),
            },
        }

    def close(self) -> None:
        """Stop the side channel and the transport."""
        self.side_channel.close()
        self.transport.close()


class PrefillRole(_Role):
    """A prefill node: holds finished prefill-leg requests' blocks for decode nodes.

    Args:
        config: the engine's config (``splitwise_config`` is read).
        kv_caches: the KV tensors to register with the transport (one per layer).
        layout: this engine's layout fingerprint (``protocol.kv_layout``).
    """

    def __init__(self, config: FDConfig, kv_caches: list, layout: dict[str, Any]) -> None:
        sw = config.splitwise_config
        self.control = PrefillControl(
            sw.pd_lease_s, sw.pd_transfer_timeout, max_hold_s=sw.pd_max_hold_s
        )
        self._transport_meta: dict[str, Any] | None = None
        super().__init__(config, kv_caches, layout, self._handle)
        if hasattr(self.transport, "authorize"):  # tcp: serve only claimed blocks
            self.transport.authorize = self.control.readable
        self._transport_meta = self.transport.local_metadata()

    def _handle(self, op: str, message: dict) -> dict:
        reply = self.control.handle(op, message)
        if op == "CLAIM":
            # Where to read, from this node itself: a decode node reads from the address this
            # node answers with, never from one a client wrote into kv_transfer_params.
            reply["transport"] = self._transport_meta
        return reply

    def hold(
        self,
        request_id: str,
        block_ids: list[int],
        num_prompt_tokens: int,
        first_token_id: int,
        first_token_logprobs: list[dict] | None = None,
        prompt_hash: str | None = None,
    ) -> dict[str, Any]:
        """Hold ``block_ids`` (the caller already took a reference on each) for a decode node;
        returns the ``kv_transfer_params`` of the answer. ``prompt_hash`` is the prompt's
        :func:`~fastdeploy.splitwise.protocol.prompt_fingerprint`: it goes into the answer, and
        CLAIM answers it, so a decode node can check the blocks hold its prompt."""
        self.control.hold(request_id, block_ids, prompt_hash)
        params = RemotePrefill(
            remote_engine_id=self.engine_id,
            remote_request_id=request_id,
            remote_host=self.config.pd_host,
            remote_port=self.side_channel.port,
            remote_block_ids=list(block_ids),
            num_prompt_tokens=num_prompt_tokens,
            first_token_id=first_token_id,
            lease_s=self.config.pd_lease_s,
            transport=self._transport_meta,
            layout=self.layout,
            first_token_logprobs=first_token_logprobs,
            prompt_hash=prompt_hash,
        ).to_dict()
        # Signed last, over every field: a decode node sharing the secret refuses a reference
        # that was forged or altered on the way (redirected address, other blocks).
        return self.auth.sign_reference(params) if self.auth is not None else params

    def take_freed(self) -> list[tuple[str, list[int], str]]:
        """``(request_id, block_ids, reason)`` of every entry released since the last call
        (DONE, ABORT or lease expiry); the engine drops its reference on each block."""
        return self.control.take_freed()

    def held_block_tables(self) -> list[list[int]]:
        """The block lists held for decode nodes (for the integrity check)."""
        return self.control.block_tables()

    @property
    def has_pending(self) -> bool:
        """Blocks held for decode nodes, or released and not yet freed."""
        return self.control.has_work

    # A prefill node pulls nothing: the decode side of PDRole answers "nothing".
    @property
    def in_flight(self) -> int:
        """0: a prefill node pulls nothing."""
        return 0

    def set_wakeup(self, wakeup: Callable[[], None] | None) -> None:
        """Nothing to wake for: what decode nodes release is freed by stepping (``has_pending``)."""

    def poll(self) -> list[PullResult]:
        """[]: a prefill node pulls nothing."""
        return []

    def set_waiting(self, remotes: list[RemotePrefill]) -> None:
        """Nothing to heartbeat: a prefill node has no decode legs."""

    def start(self, request_id: str, remote: RemotePrefill, block_ids: list[int], num_cached: int):
        """Raises RuntimeError: a prefill node has no decode legs (admission refuses them)."""
        raise _not_on("prefill", "start a pull")

    def cancel(self, request_id: str) -> None:
        """Raises RuntimeError: a prefill node has no decode legs."""
        raise _not_on("prefill", "cancel a pull")

    def abort_remote(self, remote: RemotePrefill) -> None:
        """Raises RuntimeError: a prefill node has no decode legs."""
        raise _not_on("prefill", "abort a remote prefill")

    def stats(self) -> dict[str, Any]:
        return {
            "pending_sends": self.control.num_pending,
            "pending_send_blocks": self.control.num_pending_blocks,
            **{f"{k}_total": v for k, v in self.control.counts.items()},
            **self.security_stats(),
        }


class DecodeRole(_Role):
    """A decode node: pulls prompt KV from prefill nodes.

    Args:
        config: the engine's config.
        kv_caches: the KV tensors pulls write into.
        layout: this engine's layout fingerprint.
        block_size: tokens per block (to turn prefix-cache hits into skipped blocks).
    """

    def __init__(
        self, config: FDConfig, kv_caches: list, layout: dict[str, Any], block_size: int
    ) -> None:
        super().__init__(config, kv_caches, layout, self._handle)
        self.block_size = block_size
        self.trust = PrefillTrust(
            self.config.allowed_prefill_peers, self.auth.key if self.auth is not None else None
        )
        self.loader = RemoteKVLoader(self.transport, control_timeout_s=5.0, auth=self.auth)
        self.counts = {"transfers": 0, "transfer_bytes": 0, "transfer_seconds": 0.0}
        self.failures: dict[str, int] = {}
        self._waiting: list[RemotePrefill] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._heartbeat = threading.Thread(
            target=self._heartbeats, name="pd-heartbeat", daemon=True
        )
        self._heartbeat.start()

    # A decode node holds nothing for others: the prefill side of PDRole answers "nothing".
    @property
    def has_pending(self) -> bool:
        """False: a decode node holds no blocks for other nodes."""
        return False

    def held_block_tables(self) -> list[list[int]]:
        """[]: a decode node holds no blocks for other nodes."""
        return []

    def take_freed(self) -> list[tuple[str, list[int], str]]:
        """[]: a decode node holds no blocks for other nodes."""
        return []

    def hold(
        self,
        request_id: str,
        block_ids: list[int],
        num_prompt_tokens: int,
        first_token_id: int,
        first_token_logprobs: list[dict] | None = None,
        prompt_hash: str | None = None,
    ) -> dict[str, Any]:
        """Raises RuntimeError: a decode node has no prefill legs (admission refuses them)."""
        raise _not_on("decode", "hold blocks for a decode node")

    @staticmethod
    def _handle(op: str, message: dict) -> dict:
        if op == "HEARTBEAT":
            return {}
        raise ValueError(f"op {op} is invalid on a decode node; allowed: HEARTBEAT")

    def set_wakeup(self, wakeup: Callable[[], None] | None) -> None:
        """Call ``wakeup()`` (from a transfer thread) whenever a pull ends."""
        self.loader.on_result = wakeup

    def start(self, request_id: str, remote: RemotePrefill, block_ids: list[int], num_cached: int):
        """Start pulling ``remote``'s blocks into ``block_ids`` (the request's table), skipping
        the leading blocks this node's prefix cache already had (``num_cached`` tokens)."""
        n = len(remote.remote_block_ids)
        skip = min(num_cached // self.block_size, n)
        self.loader.submit(
            PullJob(request_id, remote, block_ids[:n], skip, self.config.pd_transfer_timeout)
        )

    def abort_remote(self, remote: RemotePrefill) -> None:
        """Tell the prefill node, from a short-lived thread, that its blocks are not needed."""
        send_abort(remote.remote_host, remote.remote_port, remote.remote_request_id, auth=self.auth)

    def cancel(self, request_id: str) -> None:
        """Stop a pull (its result arrives once it can write no more)."""
        self.loader.cancel(request_id)

    def poll(self) -> list[PullResult]:
        """Pulls that ended since the last call (counted in the metrics)."""
        results = self.loader.poll()
        for r in results:
            if r.error is None:
                self.counts["transfers"] += 1
                self.counts["transfer_bytes"] += r.num_bytes
                self.counts["transfer_seconds"] += r.seconds
            else:
                reason = r.error.split(":", 1)[0]
                self.failures[reason] = self.failures.get(reason, 0) + 1
        return results

    @property
    def in_flight(self) -> int:
        return self.loader.in_flight

    def set_waiting(self, remotes: list[RemotePrefill]) -> None:
        """The decode-leg requests still waiting for blocks (their leases get heartbeats)."""
        with self._lock:
            self._waiting = list(remotes)

    def _heartbeats(self) -> None:
        """Every third of the shortest lease among the waiting requests (the prefill nodes'
        ``lease_s``, from their answers), extend those leases."""
        period = 0.5
        while not self._stop.wait(period):
            with self._lock:
                remotes = list(self._waiting)
            period = max(0.05, min([0.5] + [r.lease_s / 3 for r in remotes]))
            by_peer: dict[tuple[str, int], list[str]] = {}
            for r in remotes:
                by_peer.setdefault((r.remote_host, r.remote_port), []).append(r.remote_request_id)
            for (host, port), ids in by_peer.items():
                try:
                    send_control(host, port, "HEARTBEAT", ids, timeout_s=2.0, auth=self.auth)
                except SideChannelError as e:
                    logger.warning("heartbeat to the prefill node %s:%d failed: %s", host, port, e)

    def stats(self) -> dict[str, Any]:
        return {
            "transfers_in_flight": self.loader.in_flight,
            **self.counts,
            "failures": dict(self.failures),
            **self.security_stats(),
        }

    def close(self) -> None:
        self._stop.set()
        super().close()


def _not_on(role: str, what: str) -> RuntimeError:
    return RuntimeError(f"a {role} node cannot {what}: its admission refuses such a request leg")


def make_role(
    config: FDConfig, kv_caches: list, layout: dict[str, Any], block_size: int
) -> PDRole | None:
    """The role object of ``config.parallel_config.splitwise_role`` (None for ``mixed``).

    Raises:
        ValueError: ``nixl`` asked for and not installed. OSError: a port that cannot be bound.
    """
    role = config.parallel_config.splitwise_role
    if role == "prefill":
        return PrefillRole(config, kv_caches, layout)
    if role == "decode":
        return DecodeRole(config, kv_caches, layout, block_size)
    return None
