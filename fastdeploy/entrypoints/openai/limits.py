"""Limits on what one HTTP request may carry, and how long it may take to arrive.

A request is refused, and counted in ``fastdeploy:request_rejected_total`` under its reason, when

* its header block is larger than ``max_header_bytes`` (431, ``header_size``);
* it has more than ``max_header_count`` headers (431, ``header_count``);
* its body is larger than ``max_body_bytes`` (413, ``body_size``), refused before the body is
  read when ``Content-Length`` says so;
* its header block, or then its body, has not arrived ``read_timeout_s`` seconds after it began
  (408, ``read_timeout``): a client that announces ``Content-Length: 999999999`` and sends 13
  bytes, or drips its headers (slowloris), holds a connection that long and no longer.

Where each is enforced, and why there (libraries' own settings first):

* header size: h11 has its own limit (``h11_max_incomplete_event_size``, uvicorn's setting, which
  is what vLLM's fix of CVE-2025-48956 sets); httptools (llhttp), which uvicorn prefers when it is
  installed, has none and buffers a header of any size. So the HTTP protocol classes here
  (:func:`protocol_class`: uvicorn's own two, subclassed) count the bytes of a request's head as
  they arrive and refuse it past the limit, with either parser; h11's own limit stays set, at the
  same value, as a second guard;
* header read timeout: uvicorn has none (its keep-alive timeout covers only the idle time after a
  response), so the same protocol classes arm one when a connection opens or a head starts;
* header count, body size, body read timeout: neither uvicorn nor its parsers have them, so an
  ASGI middleware (:class:`RequestLimitsMiddleware`) enforces them; the header count can wait for
  the app because the header block's size is already bounded. Both parsers (h11's own limit too)
  let a head past the size limit when it arrived whole in one read (at most 256 KiB), so the
  middleware measures the headers again: the limit is exact.

Not used: uvicorn's ``limit_concurrency``. It counts open connections and answers every new
request with 503 past it, so slow or idle connections (exactly what an attacker holds open) would
lock out legitimate clients; ``--max-concurrency`` caps requests instead (429), and the read
timeout bounds how long a connection may stay without a request. uvicorn's own
``timeout_keep_alive`` (5 s) still closes idle connections between requests.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastdeploy.config import check

logger = logging.getLogger("fastdeploy.api_server")

#: ``on_refused(reason)``: counts a refusal (``ServerMetrics.observe_rejected``).
OnRefused = Callable[[str], None]

_STATUS_TEXT = {
    400: "Bad Request",
    408: "Request Timeout",
    413: "Content Too Large",
    431: "Request Header Fields Too Large",
}


@dataclass(frozen=True)
class HTTPLimits:
    """What one request may carry, and how long it may take to arrive.

    Attributes:
        max_header_count: headers in one request (``--h11-max-header-count``, vLLM's flag
            and default).
        max_header_bytes: bytes of the request line and headers (``--h11-max-incomplete-event
            -size``, vLLM's flag; here it bounds httptools too). A 1 MB header is refused.
        max_body_bytes: bytes of one request body (``--max-request-body-bytes``). 16 MiB is
            several times the JSON of any prompt that fits a 128K-token context.
        read_timeout_s: seconds a request's head may take to arrive, and again its body
            (``--request-read-timeout``).

    Raises:
        ValueError: a limit that is not a positive number, naming it.
    """

    max_header_count: int = 256
    max_header_bytes: int = 64 * 1024
    max_body_bytes: int = 16 * 1024 * 1024
    read_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("max_header_count", "max_header_bytes", "max_body_bytes"):
            value = getattr(self, name)
            check(
                isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                name,
                value,
                "an integer >= 1",
            )
        t = self.read_timeout_s
        check(
            isinstance(t, (int, float)) and not isinstance(t, bool) and t > 0,
            "read_timeout_s",
            t,
            "a number of seconds > 0",
        )

    def uvicorn_kwargs(self, on_refused: OnRefused, http: str = "auto") -> dict[str, Any]:
        """The ``uvicorn.Config`` arguments that enforce the header size and header read
        timeout: the protocol class (:func:`protocol_class`) and h11's own size limit."""
        return {
            "http": protocol_class(self, on_refused, http),
            "h11_max_incomplete_event_size": self.max_header_bytes,
        }


def refusal_bytes(status: int, message: str, code: str) -> bytes:
    """A complete ``Connection: close`` HTTP/1.1 response with an OpenAI-style error body, for
    a refusal made below the app (no ASGI response object exists yet)."""
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": code}
    body = json.dumps({"error": error}).encode()
    head = (
        f"HTTP/1.1 {status} {_STATUS_TEXT[status]}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


class _HeadLimits:
    """Mixin over uvicorn's HTTP protocol classes: the header-size limit and the header read
    timeout of :class:`HTTPLimits`. A subclass says when a request's head is awaited
    (:meth:`_awaiting_head`). Bytes are counted per ``data_received`` call, so a head may pass
    the limit by one read (at most 256 KiB) before it is refused; never more."""

    limits: HTTPLimits
    on_refused: OnRefused

    def connection_made(self, transport: Any) -> None:
        self._head_bytes = 0
        self._head_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)  # type: ignore[misc]
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)  # type: ignore[misc]

    def data_received(self, data: bytes) -> None:
        if self._awaiting_head():
            self._head_bytes += len(data)
            self._arm_head_timer()
        super().data_received(data)  # type: ignore[misc]
        if self.transport.is_closing():  # type: ignore[attr-defined]
            return
        if not self._awaiting_head():
            self._head_done()
        elif self._head_bytes > self.limits.max_header_bytes:
            self._refuse_head_size()

    def send_400_response(self, msg: str) -> None:
        """The parser refused the request: h11's own size limit (answered as ours), or
        malformed HTTP (uvicorn's 400, counted as ``invalid``)."""
        if self._head_bytes > self.limits.max_header_bytes:
            self._refuse_head_size()
            return
        self.on_refused("invalid")
        super().send_400_response(msg)  # type: ignore[misc]

    def _awaiting_head(self) -> bool:
        raise NotImplementedError

    def _head_done(self) -> None:
        self._head_bytes = 0
        self._disarm_head_timer()

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            loop = asyncio.get_running_loop()
            self._head_timer = loop.call_later(self.limits.read_timeout_s, self._head_timeout)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self._awaiting_head() and not self.transport.is_closing():  # type: ignore[attr-defined]
            self._refuse(
                408,
                "read_timeout",
                f"the request's headers did not arrive within {self.limits.read_timeout_s:g} s "
                "(--request-read-timeout)",
                "request_timeout",
            )

    def _refuse_head_size(self) -> None:
        limit = self.limits.max_header_bytes
        self._refuse(
            431,
            "header_size",
            f"the request's header block is larger than {limit} bytes (at least "
            f"{self._head_bytes} received); allowed: at most {limit} bytes "
            "(--h11-max-incomplete-event-size)",
            "request_header_fields_too_large",
        )

    def _refuse(self, status: int, reason: str, message: str, code: str) -> None:
        self.on_refused(reason)
        logger.debug("refused a request from %s: %s", getattr(self, "client", None), message)
        self._disarm_head_timer()
        self.transport.write(refusal_bytes(status, message, code))  # type: ignore[attr-defined]
        self.transport.close()  # type: ignore[attr-defined]


def _httptools_class() -> type:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class LimitedHttpToolsProtocol(_HeadLimits, HttpToolsProtocol):
        """uvicorn's httptools protocol with :class:`_HeadLimits`; a head is awaited from the
        connection's start and after each request's end until its headers are complete."""

        def connection_made(self, transport: Any) -> None:
            self._in_head = True
            super().connection_made(transport)

        def _awaiting_head(self) -> bool:
            return self._in_head

        def on_headers_complete(self) -> None:
            self._in_head = False
            self._head_done()
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._in_head = True

    return LimitedHttpToolsProtocol


def _h11_class() -> type:
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class LimitedH11Protocol(_HeadLimits, H11Protocol):
        """uvicorn's h11 protocol with :class:`_HeadLimits`; a head is awaited while h11 waits
        for the client's next request (its state ``IDLE``)."""

        def _awaiting_head(self) -> bool:
            return self.conn.their_state is h11.IDLE

    return LimitedH11Protocol


def protocol_class(limits: HTTPLimits, on_refused: OnRefused, http: str = "auto") -> type:
    """uvicorn's HTTP protocol class for ``http`` (``auto``: httptools when installed, else h11,
    as uvicorn chooses) with ``limits``' header size and header read timeout.

    Raises:
        ValueError: ``http`` is not ``auto``, ``httptools`` or ``h11``.
    """
    check(http in ("auto", "httptools", "h11"), "http", http, "auto, httptools, h11")
    if http == "auto":
        import importlib.util

        http = "httptools" if importlib.util.find_spec("httptools") is not None else "h11"
    base = _httptools_class() if http == "httptools" else _h11_class()
    attrs = {"limits": limits, "on_refused": staticmethod(on_refused)}
    return type(base.__name__, (base,), attrs)


class _Refusal(Exception):
    def __init__(self, status: int, reason: str, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.reason, self.message, self.code = status, reason, message, code


class RequestLimitsMiddleware:
    """ASGI middleware: the header count, body size and body read timeout of
    :class:`HTTPLimits`. It reads the whole body (within the limits) before the app runs and
    hands it on in one message; later ``receive`` calls (a disconnect) pass through."""

    def __init__(self, app: Any, limits: HTTPLimits, on_refused: OnRefused) -> None:
        self.app = app
        self.limits = limits
        self.on_refused = on_refused

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            self._check_head(scope["headers"])
            body = await self._read_body(receive)
        except _Refusal as r:
            await self._refuse(scope, receive, send, r)
            return
        if body is None:  # the client left before its body arrived: nobody to answer
            return
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    def _check_head(self, headers: list[tuple[bytes, bytes]]) -> None:
        limits = self.limits
        if len(headers) > limits.max_header_count:
            raise _Refusal(
                431,
                "header_count",
                f"the request has {len(headers)} headers; allowed: at most "
                f"{limits.max_header_count} (--h11-max-header-count)",
                "request_header_fields_too_large",
            )
        # The protocol refuses a head still incomplete past the limit; one that arrived whole in
        # a single read (at most 256 KiB) is measured here, so the limit is exact.
        size = sum(len(name) + len(value) + 4 for name, value in headers)
        if size > limits.max_header_bytes:
            raise _Refusal(
                431,
                "header_size",
                f"the request's headers are {size} bytes; allowed: at most "
                f"{limits.max_header_bytes} bytes (--h11-max-incomplete-event-size)",
                "request_header_fields_too_large",
            )
        for name, value in headers:
            if name == b"content-length" and value.strip().isdigit():
                if int(value) > limits.max_body_bytes:
                    raise self._too_large(f"Content-Length: {int(value)}")

    def _too_large(self, what: str) -> _Refusal:
        limit = self.limits.max_body_bytes
        return _Refusal(
            413,
            "body_size",
            f"the request body ({what}) is larger than {limit} bytes; allowed: at most {limit} "
            "bytes (--max-request-body-bytes)",
            "request_too_large",
        )

    async def _read_body(self, receive: Callable) -> bytes | None:
        """The whole body, or None when the client disconnected first.

        Raises:
            _Refusal: too large, or not complete within the read timeout.
        """
        loop = asyncio.get_running_loop()
        timeout = self.limits.read_timeout_s
        deadline = loop.time() + timeout
        chunks: list[bytes] = []
        size = 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                raise _Refusal(
                    408,
                    "read_timeout",
                    f"the request body did not arrive within {timeout:g} s ({size} bytes "
                    "received) (--request-read-timeout)",
                    "request_timeout",
                ) from None
            if message["type"] != "http.request":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limits.max_body_bytes:
                raise self._too_large(f"at least {size} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _refuse(self, scope: dict, receive: Callable, send: Callable, r: _Refusal) -> None:
        from fastdeploy.entrypoints.openai.errors import APIError

        self.on_refused(r.reason)
        error = APIError(r.status, r.message, code=r.code, headers={"Connection": "close"})
        await error.response()(scope, receive, send)
