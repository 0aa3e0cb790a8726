"""Prefill/decode disaggregation: side channel, KV transfer and its timeouts:
:class:`SplitwiseConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastdeploy.config.checks import check, is_number

CACHE_TRANSFER_PROTOCOLS = ("auto", "nixl", "tcp")
KV_LOAD_FAILURE_POLICIES = ("fail", "recompute")


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
    """

    pd_comm_port: int | None = None
    pd_host: str = "127.0.0.1"
    cache_transfer_protocol: str = "auto"
    pd_lease_s: float = 30.0
    kv_load_failure_policy: str = "fail"
    pd_decode_wait_timeout: float = 30.0
    pd_transfer_timeout: float = 30.0

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
        for name in ("pd_lease_s", "pd_decode_wait_timeout", "pd_transfer_timeout"):
            value = getattr(self, name)
            check(is_number(value) and 0 < value < float("inf"), name, value, "finite seconds > 0")
