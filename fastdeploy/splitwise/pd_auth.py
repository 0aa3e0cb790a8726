"""PD peers that prove who they are: a shared secret signs every side-channel message, every
``tcp`` KV read and every KV reference (``kv_transfer_params``) a prefill node hands out.

The MAC is HMAC-SHA256 (RFC 2104, stdlib :mod:`hmac`) over a purpose string, a timestamp, a random
nonce and the message as canonical JSON (sorted keys, no spaces, ASCII), so a message signed for
one purpose (``side-channel``) cannot be replayed as another (``kv-read``). A receiver refuses, in
this order, an unsigned message, a wrong MAC, a timestamp outside ``window_s`` of its own clock
(stale), and a nonce it has already seen within the window (replayed); each refusal is counted by
reason. The MAC is checked first, so a peer without the secret cannot fill the nonce cache.

KV references are signed without a nonce (:meth:`PDAuth.sign_reference`): the prefill node's
one-shot CLAIM already makes a second use of the same reference fail, and a reference may wait
on the router or in the decode node's queue longer than the message window.

Where the secret comes from (:func:`load_pd_secret`): ``--pd-secret-file PATH`` (the file's
bytes, trailing whitespace stripped), else the environment variable ``FD_PD_SECRET``. A secret
never goes on a command line, where every user of the host can read it in ``ps``.
"""

from __future__ import annotations

import heapq
import hmac
import ipaddress
import json
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from hashlib import sha256
from typing import Any

from fastdeploy import envs
from fastdeploy.config.splitwise import parse_peer

__all__ = [
    "AuthError",
    "PDAuth",
    "PrefillTrust",
    "is_loopback",
    "load_pd_secret",
    "parse_peer",
    "process_auth",
    "set_process_auth",
]

#: Seconds a signed message stays valid either side of the receiver's clock (and how long its
#: nonce is remembered).
WINDOW_S = 30.0
#: Shortest secret accepted (bytes); RFC 2104 advises a key no shorter than the hash output
#: (32 B for SHA-256), 16 random bytes are already out of reach of a brute force.
MIN_SECRET_BYTES = 16
#: The field of a signed message (or KV reference) that carries its signature.
AUTH_FIELD = "auth"
#: Why a message was refused (the ``reason`` label of ``fastdeploy:pd_auth_rejected``).
REASONS = ("unsigned", "malformed", "bad_signature", "stale", "replayed")


class AuthError(ValueError):
    """A message is refused; :attr:`reason` is one of :data:`REASONS`."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"PD authentication failed ({reason}): {message}")
        self.reason = reason


def load_pd_secret(secret_file: str | None) -> bytes | None:
    """The PD secret: the bytes of ``secret_file`` (trailing whitespace stripped) when given,
    else ``FD_PD_SECRET``, else None (PD runs unauthenticated).

    Raises:
        ValueError: the file cannot be read, or the secret is shorter than
            :data:`MIN_SECRET_BYTES` (naming the file or the variable).
    """
    if secret_file:
        try:
            with open(secret_file, "rb") as f:
                secret, source = f.read().rstrip(), f"--pd-secret-file={secret_file}"
        except OSError as e:
            raise ValueError(f"--pd-secret-file={secret_file!r} cannot be read: {e}") from None
    else:
        raw = envs.FD_PD_SECRET()
        if raw is None:
            return None
        secret, source = raw.encode(), "FD_PD_SECRET"
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(
            f"the PD secret from {source} has {len(secret)} bytes; allowed: at least "
            f"{MIN_SECRET_BYTES} (e.g. `openssl rand -hex 32`)"
        )
    return secret


def canonical(message: dict[str, Any]) -> bytes:
    """``message`` without its :data:`AUTH_FIELD`, as canonical JSON bytes (the MAC's input)."""
    body = {k: v for k, v in message.items() if k != AUTH_FIELD}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


@dataclass
class PDAuth:
    """Signs and verifies PD messages with one shared secret (thread-safe).

    Args:
        key: the shared secret (:func:`load_pd_secret`).
        window_s: how far a timestamp may be from this node's clock, in seconds.
        clock: wall-clock seconds (``time.time``; peers on different hosts compare timestamps,
            so their clocks must agree to well within ``window_s``, e.g. through NTP).

    Attributes:
        rejected: refusals so far, by reason (:data:`REASONS`).
    """

    key: bytes = field(repr=False)
    window_s: float = WINDOW_S
    clock: Callable[[], float] = time.time
    rejected: dict[str, int] = field(default_factory=dict)
    _nonces: set[str] = field(default_factory=set, repr=False)
    #: ``(forget_at, nonce)`` min-heap: each nonce is dropped once its message would be stale.
    _expiry: list[tuple[float, str]] = field(default_factory=list, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def from_secret_file(cls, secret_file: str | None) -> PDAuth | None:
        """A :class:`PDAuth` on :func:`load_pd_secret`'s secret, or None without one."""
        key = load_pd_secret(secret_file)
        return None if key is None else cls(key)

    def _mac(self, purpose: str, ts_ms: int, nonce: str, message: dict[str, Any]) -> str:
        head = f"fastdeploy-pd-v1\n{purpose}\n{ts_ms}\n{nonce}\n".encode()
        return hmac.new(self.key, head + canonical(message), sha256).hexdigest()

    def sign(self, purpose: str, message: dict[str, Any]) -> dict[str, Any]:
        """A copy of ``message`` with :data:`AUTH_FIELD` ``{"ts", "nonce", "mac"}`` added."""
        ts_ms = int(self.clock() * 1000)
        nonce = secrets.token_hex(16)
        mac = self._mac(purpose, ts_ms, nonce, message)
        return {**message, AUTH_FIELD: {"ts": ts_ms, "nonce": nonce, "mac": mac}}

    def verify(self, purpose: str, message: dict[str, Any]) -> None:
        """Accept a signed ``message`` once.

        Raises:
            AuthError: unsigned, malformed, a wrong MAC, stale or replayed (counted).
        """
        auth = message.get(AUTH_FIELD)
        if auth is None:
            self._refuse(
                "unsigned",
                "the message carries no signature; is the peer started "
                "with the same --pd-secret-file or FD_PD_SECRET?",
            )
        ts, nonce, mac = (
            auth.get(k) if isinstance(auth, dict) else None for k in ("ts", "nonce", "mac")
        )
        if (
            type(ts) is not int
            or not isinstance(nonce, str)
            or not 16 <= len(nonce) <= 64
            or not isinstance(mac, str)
        ):
            self._refuse(
                "malformed",
                f"{AUTH_FIELD}={str(auth)[:200]} is invalid; allowed: "
                '{"ts": <ms>, "nonce": <16..64 chars>, "mac": <hex>}',
            )
        if not hmac.compare_digest(mac, self._mac(purpose, ts, nonce, message)):
            self._refuse(
                "bad_signature",
                "the MAC does not match (another secret, or the message was altered)",
            )
        now = self.clock()
        age = now - ts / 1000
        if abs(age) > self.window_s:
            self._refuse(
                "stale",
                f"signed {abs(age):.1f} s {'ago' if age > 0 else 'in the future'} by this "
                f"node's clock; allowed: within {self.window_s:g} s (are the clocks in sync?)",
            )
        with self._lock:
            self._forget(now)
            if nonce in self._nonces:
                self._count("replayed")
                raise AuthError("replayed", f"nonce {nonce} was already used")
            self._nonces.add(nonce)
            heapq.heappush(self._expiry, (ts / 1000 + self.window_s, nonce))

    def sign_reference(self, params: dict[str, Any]) -> dict[str, Any]:
        """A copy of a KV reference (``kv_transfer_params``) with its MAC in :data:`AUTH_FIELD`."""
        mac = self._mac("kv-ref", 0, "-", params)
        return {**params, AUTH_FIELD: {"mac": mac}}

    def verify_reference(self, params: dict[str, Any]) -> None:
        """Accept a KV reference signed by a holder of the secret (any field changed fails).

        Raises:
            AuthError: unsigned or a wrong MAC (counted).
        """
        auth = params.get(AUTH_FIELD)
        mac = auth.get("mac") if isinstance(auth, dict) else None
        if not isinstance(mac, str):
            self._refuse(
                "unsigned",
                "kv_transfer_params carry no prefill node's signature "
                f"({AUTH_FIELD}.mac); allowed: the prefill node's answer, unchanged",
            )
        if not hmac.compare_digest(mac, self._mac("kv-ref", 0, "-", params)):
            self._refuse(
                "bad_signature",
                "kv_transfer_params were not signed with this node's "
                "PD secret, or were altered after the prefill node signed them",
            )

    def _forget(self, now: float) -> None:
        """Drop the nonces of messages that are stale by now (O(log n) each)."""
        while self._expiry and self._expiry[0][0] < now:
            self._nonces.discard(heapq.heappop(self._expiry)[1])

    def _count(self, reason: str) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1

    def _refuse(self, reason: str, message: str):
        with self._lock:
            self._count(reason)
        raise AuthError(reason, message)


# --------------------------------------------------------------------- the process's own auth
_process_auth: PDAuth | None = None


def set_process_auth(auth: PDAuth | None) -> None:
    """The :class:`PDAuth` that :func:`~fastdeploy.splitwise.side_channel.send_control` signs
    with when its caller passes none: set once at start by a PD node or the router, so every
    caller of ``send_control`` in the process signs without threading the key through."""
    global _process_auth
    _process_auth = auth


def process_auth() -> PDAuth | None:
    """See :func:`set_process_auth`."""
    return _process_auth


# --------------------------------------------------------------------- which prefill peers
def is_loopback(host: str) -> bool:
    """``localhost`` or a loopback address (no name is resolved: that could change later)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class PrefillTrust:
    """Which prefill nodes a decode node pulls from (checked at admission, before any
    connection; picklable, it travels with the server's ``Admission``).

    * ``allowed`` set (``--pd-allowed-prefill``): the reference's ``remote_host:remote_port``
      must be one of them;
    * ``key`` set (a PD secret): the reference must carry a prefill node's valid signature;
    * neither: only loopback prefill nodes (one host; the node warned at start).

    Attributes:
        allowed: ``(host, port)`` side channels, or None.
        key: the PD secret, or None.
    """

    allowed: tuple[tuple[str, int], ...] | None = None
    key: bytes | None = field(default=None, repr=False)

    def check(self, params: dict[str, Any]) -> None:
        """Refuse a decode leg's ``kv_transfer_params`` from an untrusted prefill node.

        Raises:
            ValueError: the address is not allowed (naming it and what is), or the signature
                is missing or wrong (an :class:`AuthError`).
        """
        host, port = params.get("remote_host"), params.get("remote_port")
        if self.allowed is not None:
            if (host, port) not in self.allowed:
                listed = ",".join(f"{h}:{p}" for h, p in self.allowed)
                raise ValueError(
                    f"kv_transfer_params.remote_host:remote_port={host}:{port} is not allowed; "
                    f"allowed (--pd-allowed-prefill): {listed}"
                )
        elif self.key is None and not (isinstance(host, str) and is_loopback(host)):
            raise ValueError(
                f"kv_transfer_params.remote_host={host!r} is not allowed; allowed without a PD "
                "secret or --pd-allowed-prefill: loopback prefill nodes only (127.0.0.1, ::1, "
                "localhost)"
            )
        if self.key is not None:
            PDAuth(self.key).verify_reference(params)
