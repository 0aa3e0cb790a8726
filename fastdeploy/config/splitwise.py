"""Prefill/decode disaggregation: side channel, KV transfer and its timeouts:
:class:`SplitwiseConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastdeploy.config.checks import check, check_int, is_number

CACHE_TRANSFER_PROTOCOLS = ("auto", "nixl", "tcp")
KV_LOAD_FAILURE_POLICIES = ("fail", "recompute")


def parse_peer(entry: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` for IPv6) as ``(host, port)``.

    Raises:
        ValueError: not ``host:port`` with a port in 1..65535 (naming the entry).
    """
    host, sep, port = entry.strip().rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"pd_allowed_prefill entry {entry!r} is invalid; allowed: host:port (the prefill "
            "node's --pd-host and --pd-comm-port), e.g. 10.0.0.5:5601"
        )
    return host, int(port)


@dataclass
class SplitwiseConfig:
    """Prefill/decode disaggregation (``docs/pd-disaggregation.md``, shared docs); read only
    when ``splitwise_role`` is ``prefill`` or ``decode``.

    Attributes:
        pd_comm_port: TCP port of this node's control side channel (None: a free port).
        pd_host: the address this node advertises to its peers (side channel and transport).
        cache_transfer_protocol: ``auto`` (NIXL when it imports, else tcp), ``nixl`` or ``tcp``.
        pd_lease_s: seconds a prefill node holds a finished request's blocks unclaimed (and how
            far a heartbeat extends them).
        kv_load_failure_policy: on the decode node, ``fail`` (a 5xx) or ``recompute`` (prefill
            the request locally, eagerly) when a KV transfer fails.
        pd_decode_wait_timeout: seconds a decode-leg request may wait for free blocks before it
            gets a 503.
        pd_transfer_timeout: the deadline of one pull on a decode node, in seconds (CLAIM, read
            and DONE together; a stalled peer's failure is reported at it), and how long a
            prefill node keeps a claimed entry.
        pd_secret_file: a file holding the secret every PD peer shares (the prefill node, the
            decode node, ``fastdeploy router``); None: ``FD_PD_SECRET``, else unauthenticated.
            Only the path is kept here (the config is printed by ``/v1/server_info``).
        pd_allowed_prefill: on a decode node, the prefill side channels (``host:port``, as the
            prefill node advertises them) it pulls from; None: any that proves the secret, or
            without a secret loopback ones only.
        pd_max_connections: connections served at once by the side channel and by the tcp KV
            port, each (more are refused and counted).
        pd_max_hold_s: on a prefill node, the longest time heartbeats may keep a finished
            request's blocks held for a decode node, from when they were first held; a claim
            still gets its full ``pd_transfer_timeout``.
    """

    pd_comm_port: int | None = None
    pd_host: str = "127.0.0.1"
    cache_transfer_protocol: str = "auto"
    pd_lease_s: float = 30.0
    kv_load_failure_policy: str = "fail"
    pd_decode_wait_timeout: float = 30.0
    pd_transfer_timeout: float = 30.0
    pd_secret_file: str | None = None
    pd_allowed_prefill: list[str] | None = None
    pd_max_connections: int = 256
    pd_max_hold_s: float = 300.0

    def __post_init__(self) -> None:
        check(
            self.pd_comm_port is None
            or (isinstance(self.pd_comm_port, int) and 0 < self.pd_comm_port < 65536),
            "pd_comm_port",
            self.pd_comm_port,
            "a TCP port in 1..65535 or null",
        )
        check(
            isinstance(self.pd_host, str) and self.pd_host != "",
            "pd_host",
            self.pd_host,
            "a host name or address",
        )
        check(
            self.cache_transfer_protocol in CACHE_TRANSFER_PROTOCOLS,
            "cache_transfer_protocol",
            self.cache_transfer_protocol,
            ", ".join(CACHE_TRANSFER_PROTOCOLS),
        )
        check(
            self.kv_load_failure_policy in KV_LOAD_FAILURE_POLICIES,
            "kv_load_failure_policy",
            self.kv_load_failure_policy,
            ", ".join(KV_LOAD_FAILURE_POLICIES),
        )
        for name in (
            "pd_lease_s",
            "pd_decode_wait_timeout",
            "pd_transfer_timeout",
            "pd_max_hold_s",
        ):
            value = getattr(self, name)
            check(is_number(value) and 0 < value < float("inf"), name, value, "finite seconds > 0")
        check(
            self.pd_max_hold_s >= self.pd_lease_s,
            "pd_max_hold_s",
            self.pd_max_hold_s,
            f"seconds >= pd_lease_s ({self.pd_lease_s:g})",
        )
        check(
            self.pd_secret_file is None
            or (isinstance(self.pd_secret_file, str) and self.pd_secret_file != ""),
            "pd_secret_file",
            self.pd_secret_file,
            "a path or null",
        )
        check_int("pd_max_connections", self.pd_max_connections, minimum=1)
        if self.pd_allowed_prefill is not None:
            check(
                isinstance(self.pd_allowed_prefill, list) and bool(self.pd_allowed_prefill),
                "pd_allowed_prefill",
                self.pd_allowed_prefill,
                "a non-empty list of host:port, or null",
            )
            for entry in self.pd_allowed_prefill:
                parse_peer(entry)  # ValueError naming the entry

    @property
    def allowed_prefill_peers(self) -> tuple[tuple[str, int], ...] | None:
        """:attr:`pd_allowed_prefill` as ``(host, port)`` pairs (None when not set)."""
        if self.pd_allowed_prefill is None:
            return None
        return tuple(parse_peer(e) for e in self.pd_allowed_prefill)
