"""A threading TCP server with a cap on open connections, for the PD side channel and the ``tcp``
KV transport: each connection costs a thread, so without a cap 300 idle connections are 300
threads. A connection over the cap gets one JSON error line and is closed at once; refusals are
counted. Each handler sets its own socket timeouts (idle and per read)."""

from __future__ import annotations

import json
import socketserver
import threading

#: Default of ``--pd-max-connections``: open connections per listener (side channel, KV port).
MAX_CONNECTIONS = 256


class CappedTCPServer(socketserver.ThreadingTCPServer):
    """``ThreadingTCPServer`` that serves at most ``max_connections`` connections at once.

    Args:
        address: ``(host, port)`` to bind.
        handler: the request handler class.
        max_connections: connections served at once; more are refused.
        name: what the refusal message calls this listener (e.g. ``PD side channel``).

    Attributes:
        refused: connections refused so far for being over the cap.

    Raises:
        ValueError: ``max_connections`` < 1. OSError: the address cannot be bound.
    """

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address, handler, max_connections: int, name: str) -> None:
        if not (isinstance(max_connections, int) and max_connections >= 1):
            raise ValueError(
                f"pd_max_connections={max_connections!r} is invalid; allowed: an integer >= 1"
            )
        self.max_connections = max_connections
        self.refused = 0
        self._slots = threading.BoundedSemaphore(max_connections)
        self._refusal = (
            json.dumps(
                {
                    "ok": False,
                    "error": f"{name}: too many connections; allowed: "
                    f"{max_connections} at once (--pd-max-connections)",
                }
            )
            + "\n"
        ).encode()
        super().__init__(address, handler)

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            try:
                request.settimeout(1.0)
                request.sendall(self._refusal)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()
