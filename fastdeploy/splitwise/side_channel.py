"""The PD control side channel: JSON lines over TCP on ``--pd-comm-port``.

One request, one reply, one line each (UTF-8 JSON objects ending in ``\\n``):

* request ``{"op": "CLAIM" | "DONE" | "ABORT" | "HEARTBEAT", "request_ids": [...], ...}``;
* reply ``{"ok": true, ...}`` or ``{"ok": false, "error": "..."}``.

The decode node CLAIMs a prefill node's pending blocks before it reads them, so it never reads
blocks that were freed and reused; DONE and ABORT free them; HEARTBEAT extends their lease. The
router ABORTs the prefill leg's blocks when the decode leg fails. The design is in
``docs/pd-disaggregation.md`` (shared docs). Only the standard library is used: the data itself
moves through a transfer library, never through this channel.

With a PD secret (:mod:`~fastdeploy.splitwise.pd_auth`), every request carries an HMAC over the
message, a timestamp and a nonce; the server refuses unsigned, wrongly signed, stale and replayed
requests with ``ok: false`` before the handler sees them, and counts them. Replies are not signed:
an attacker who can alter traffic on the path can also alter the KV data, which is not encrypted.
At most ``max_connections`` connections are served at once; a silent one is closed after
:data:`IDLE_TIMEOUT_S`.
"""

from __future__ import annotations

import json
import logging
import socket
import socketserver
import threading
from collections.abc import Callable
from typing import Any

from fastdeploy.splitwise.capped_server import MAX_CONNECTIONS, CappedTCPServer
from fastdeploy.splitwise.pd_auth import AuthError, PDAuth, process_auth

logger = logging.getLogger(__name__)

OPS = ("CLAIM", "DONE", "ABORT", "HEARTBEAT")
#: Longest accepted line (bytes); a longer one is answered with an error and the connection closed.
MAX_LINE_BYTES = 1 << 20
#: Seconds a connection may stay silent before the server closes it.
IDLE_TIMEOUT_S = 30.0

Handler = Callable[[str, dict[str, Any]], dict[str, Any]]
#: The ``purpose`` side-channel messages are signed for (:meth:`PDAuth.sign`).
PURPOSE = "side-channel"
#: ``auth=`` default of :func:`send_control`: the process's own (:func:`set_process_auth`).
PROCESS_AUTH: Any = object()


class SideChannelError(RuntimeError):
    """The peer could not be reached, closed the connection, or answered ``ok: false``."""


def send_control(
    host: str,
    port: int,
    op: str,
    request_ids: list[str],
    timeout_s: float = 5.0,
    *,
    auth: PDAuth | None = PROCESS_AUTH,
    **extra: Any,
) -> dict[str, Any]:
    """Send one control message and return the peer's reply.

    Args:
        host, port: the peer's side channel (``remote_host``/``remote_port`` of
            ``kv_transfer_params``).
        op: one of :data:`OPS`.
        request_ids: the requests it is about.
        timeout_s: limit for connecting and for the reply, in seconds.
        auth: signs the message; by default the process's PD secret
            (:func:`~fastdeploy.splitwise.pd_auth.set_process_auth`), None sends it unsigned.
        extra: further JSON fields of the message.

    Raises:
        ValueError: an unknown ``op``.
        SideChannelError: no connection, no reply within ``timeout_s``, a malformed reply, or
            ``ok: false`` (its ``error`` is in the message).
    """
    if op not in OPS:
        raise ValueError(f"op={op!r} is invalid; allowed: {', '.join(OPS)}")
    if auth is PROCESS_AUTH:
        auth = process_auth()
    message = {"op": op, "request_ids": list(request_ids), **extra}
    if auth is not None:
        message = auth.sign(PURPOSE, message)
    line = json.dumps(message) + "\n"
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.sendall(line.encode())
            reply = sock.makefile("rb").readline(MAX_LINE_BYTES + 1)
    except OSError as e:
        raise SideChannelError(f"{op} to {host}:{port} failed: {e}") from e
    try:
        answer = json.loads(reply)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SideChannelError(f"{op} to {host}:{port}: malformed reply {reply[:200]!r}") from e
    if not isinstance(answer, dict) or not answer.get("ok"):
        error = answer.get("error") if isinstance(answer, dict) else answer
        raise SideChannelError(f"{op} to {host}:{port} refused: {error}")
    return answer


class _Connection(socketserver.StreamRequestHandler):
    timeout = IDLE_TIMEOUT_S  # a silent peer's connection (and thread) ends

    def handle(self) -> None:
        try:
            while True:
                line = self.rfile.readline(MAX_LINE_BYTES + 1)
                if not line:
                    return
                reply = self.server.dispatch(line)  # type: ignore[attr-defined]
                self.wfile.write((json.dumps(reply) + "\n").encode())
                if len(line) > MAX_LINE_BYTES:
                    return
        except OSError:  # idle timeout, or the peer reset the connection
            return


class SideChannelServer:
    """Serves control messages on ``host:port`` on a background thread.

    Args:
        host: address to bind (``127.0.0.1`` for one host; the node's address across hosts).
        port: TCP port (0 picks a free one; see :attr:`port`).
        handler: ``handler(op, message) -> reply fields``; called on the server's threads, so it
            must be thread-safe (the PD roles hand the message to the engine thread). It raises
            ``ValueError`` or ``KeyError`` to answer ``ok: false``.
        auth: when set, only requests it verifies reach ``handler``; None accepts any.
        max_connections: connections served at once (more are refused and counted).

    Raises:
        OSError: the port cannot be bound (the message names it).
    """

    def __init__(
        self,
        host: str,
        port: int,
        handler: Handler,
        auth: PDAuth | None = None,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self._handler = handler
        self.auth = auth
        try:
            self._server = CappedTCPServer(
                (host, port), _Connection, max_connections, "PD side channel"
            )
        except OSError as e:
            raise OSError(f"cannot listen on the PD side channel {host}:{port}: {e}") from e
        self._server.dispatch = self._dispatch  # type: ignore[attr-defined]
        self.host, self.port = self._server.server_address[:2]
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="pd-side-channel", daemon=True
        )

    def start(self) -> SideChannelServer:
        self._thread.start()
        return self

    @property
    def refused_connections(self) -> int:
        """Connections refused for being over ``max_connections``."""
        return self._server.refused

    def close(self) -> None:
        """Stop serving and release the port."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def _dispatch(self, line: bytes) -> dict[str, Any]:
        if len(line) > MAX_LINE_BYTES:
            return {"ok": False, "error": f"message longer than {MAX_LINE_BYTES} bytes"}
        try:
            message = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            return {"ok": False, "error": f"not a JSON line: {line[:200]!r}"}
        op = message.get("op") if isinstance(message, dict) else None
        if op not in OPS:
            return {"ok": False, "error": f"op={op!r} is invalid; allowed: {', '.join(OPS)}"}
        ids = message.get("request_ids")
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            return {"ok": False, "error": f"request_ids={ids!r} is invalid; allowed: a list of ids"}
        if self.auth is not None:
            try:
                self.auth.verify(PURPOSE, message)
            except AuthError as e:
                n = self.auth.rejected.get(e.reason, 0)
                if n & (n - 1) == 0:  # the 1st, 2nd, 4th, ... of a reason: no log flood
                    logger.warning("side channel refused %s (%d so far): %s", op, n, e)
                return {"ok": False, "error": str(e), "reason": e.reason}
        try:
            return {"ok": True, **self._handler(op, message)}
        except (ValueError, KeyError) as e:
            return {"ok": False, "error": str(e)}
        except Exception as e:  # noqa: BLE001 - a bad message must not kill the channel
            logger.exception("side channel handler failed on %s", op)
            return {"ok": False, "error": f"internal error: {e!r}"}
