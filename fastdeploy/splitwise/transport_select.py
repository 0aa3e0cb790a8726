"""Choosing the KV transport for ``--cache-transfer-protocol``.

Kept apart from :mod:`fastdeploy.splitwise.transport`, which the concrete transports import for
their shared types: the factory imports the transports, so living there made an import circle.
"""

from __future__ import annotations

import importlib.util
import logging

from fastdeploy.splitwise.transport import PROTOCOLS

logger = logging.getLogger(__name__)


def make_transport(
    protocol: str,
    host: str = "127.0.0.1",
    name: str = "fastdeploy",
    auth=None,
    max_connections: int | None = None,
):
    """The KV transport for ``--cache-transfer-protocol``: ``nixl``, ``tcp``, or ``auto`` (NIXL
    when ``import nixl`` works, else tcp; the choice is logged).

    Args:
        protocol: one of :data:`PROTOCOLS`.
        host: the address this node's transport advertises.
        name: a name unique to this engine (the NIXL agent name).
        auth: the node's :class:`~fastdeploy.splitwise.pd_auth.PDAuth` (tcp signs and verifies
            every read with it; NIXL's reads are one-sided RDMA/UCX and cannot be signed).
        max_connections: the tcp server's connection cap (None: its default).

    Raises:
        ValueError: an unknown protocol, or ``nixl`` asked for explicitly and not installed.
    """
    if protocol not in PROTOCOLS:
        raise ValueError(
            f"cache_transfer_protocol={protocol!r} is invalid; allowed: {', '.join(PROTOCOLS)}"
        )
    has_nixl = importlib.util.find_spec("nixl") is not None
    if protocol == "nixl" and not has_nixl:
        raise ValueError(
            "cache_transfer_protocol='nixl' but nixl is not installed (pip install nixl, or use "
            "'tcp' or 'auto')"
        )
    if protocol == "nixl" or (protocol == "auto" and has_nixl):
        from fastdeploy.splitwise.nixl_transport import NixlKVTransport

        chosen = NixlKVTransport(name, host)
    else:
        from fastdeploy.splitwise.tcp_transport import TcpKVTransport

        extra = {} if max_connections is None else {"max_connections": max_connections}
        chosen = TcpKVTransport(host, auth=auth, **extra)
    logger.info("KV transport: %s (cache_transfer_protocol=%s)", chosen.name, protocol)
    return chosen
