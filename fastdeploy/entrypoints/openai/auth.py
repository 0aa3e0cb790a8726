"""``--api-key``: clients must send ``Authorization: Bearer <key>`` (vLLM's flag and behaviour).

Keys come from ``--api-key`` (one or more; any of them is accepted, as vLLM accepts a list), else
the environment: ``FD_API_KEY``, else ``VLLM_API_KEY`` (vLLM's variable, so a vLLM deployment's
environment carries over). Every path is guarded except :data:`OPEN_PATHS` (``/health``,
``/ping``, ``/version``, ``/metrics``), which stay open as vLLM's do (load balancers, fleet probes
and Prometheus poll them); so every ``/v1`` route, with ``/v1/server_info``, and ``/tokenize`` and
``/detokenize`` need the key. A request without it, or with another, gets a 401 with an
OpenAI-style body (``code: invalid_api_key``), is counted as ``unauthorized`` in
``fastdeploy:request_rejected_total``, and its body is never read. Keys are compared in constant
time (:func:`hmac.compare_digest`, against every key) and never logged or printed
(:func:`mask`).
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

#: Paths served without a key: health checks (``/health`` and its alias ``/ping``), the version
#: probe and Prometheus scrapes. vLLM (v0.11.0, ``AuthenticationMiddleware`` in
#: vllm/entrypoints/openai/api_server.py) guards only paths under ``/v1``, so these are open
#: there too; its ``/tokenize`` and ``/detokenize`` are open as well, which here need the key
#: (they run the tokenizer, up to seconds of CPU per request, for whoever calls).
OPEN_PATHS = frozenset({"/health", "/ping", "/version", "/metrics"})
#: Environment variables read, in order, when no ``--api-key`` is given.
API_KEY_ENV = ("FD_API_KEY", "VLLM_API_KEY")


def resolve_api_keys(
    given: Sequence[str] | None, environ: Mapping[str, str] = os.environ, flag: str = "--api-key"
) -> list[str]:
    """The keys to require: ``given`` (the flag's values), else the first of
    :data:`API_KEY_ENV` that is set and not empty; [] when none (the server is open).

    Raises:
        ValueError: a key that is empty or holds whitespace or a character outside printable
            ASCII (it could not travel in a header), naming which one but not its value.
    """
    if given:
        keys, source = list(given), flag
    else:
        name = next((n for n in API_KEY_ENV if environ.get(n)), None)
        keys, source = ([environ[name]], name) if name else ([], flag)
    for i, key in enumerate(keys, start=1):
        if not key or not all(33 <= ord(c) <= 126 for c in key):
            which = f"value {i} of {source}" if len(keys) > 1 else source
            raise ValueError(
                f"{which} is invalid (not shown); allowed: a non-empty key of printable ASCII "
                "without spaces"
            )
    return keys


def mask(keys: Sequence[str] | None) -> str | None:
    """What ``--print-config`` and ``/v1/server_info`` show for the keys: None when there are
    none, else ``"<N key(s), hidden>"``."""
    if not keys:
        return None
    return f"<{len(keys)} key{'s' if len(keys) > 1 else ''}, hidden>"


def bearer_matches(authorization: bytes | None, keys: Sequence[bytes]) -> bool:
    """True when ``authorization`` is ``Bearer <one of keys>``; the token is compared with every
    key in constant time (no early exit that would tell which one, or where, it differs)."""
    if not authorization:
        return False
    scheme, _, token = authorization.strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return False
    token = token.strip()
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(token, key)
    return matched


class APIKeyMiddleware:
    """ASGI middleware that refuses every HTTP request outside ``open_paths`` without a valid
    ``Authorization: Bearer`` key: 401, ``WWW-Authenticate: Bearer``, ``on_refused`` called
    with ``"unauthorized"``.

    Raises:
        ValueError: no keys (the middleware would refuse everything).
    """

    def __init__(
        self,
        app: Any,
        keys: Sequence[str],
        on_refused: Callable[[str], None],
        open_paths: frozenset[str] = OPEN_PATHS,
    ) -> None:
        if not keys:
            raise ValueError("keys=[] is invalid; allowed: at least one API key")
        self.app = app
        self._keys = [k.encode("ascii") for k in keys]
        self.on_refused = on_refused
        self.open_paths = open_paths

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            authorization = next((v for k, v in scope["headers"] if k == b"authorization"), None)
            if not bearer_matches(authorization, self._keys):
                await self._refuse(scope, receive, send, authorization is None)
                return
        await self.app(scope, receive, send)

    async def _refuse(self, scope: dict, receive: Callable, send: Callable, missing: bool) -> None:
        from fastdeploy.entrypoints.openai.errors import APIError

        self.on_refused("unauthorized")
        what = "no API key was sent" if missing else "the API key is not valid"
        error = APIError(
            401,
            f"{what}; send it as 'Authorization: Bearer <key>' (this server runs with --api-key)",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
        await error.response()(scope, receive, send)
