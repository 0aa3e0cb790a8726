"""Many concurrent streams against a server, each judged: the load of ``benchmark_soak.py`` and of
the load tests (``tests/entrypoints/test_load.py``).

Raw HTTP/1.1 over asyncio sockets, one connection per request: ``httpx`` spends about 70 us of CPU
per streamed chunk on a small host (see ``sse_client.py``), and a client that leaves mid-stream
must be able to drop its socket at a chosen point. Each request ends in one outcome:

* ``ok``: a 200 stream of SSE events without an error event, whose last choice has a
  ``finish_reason``, ended by ``data: [DONE]``; a ``length`` finish must have ``max_tokens``
  completion tokens (the closing usage event's count);
* ``aborted``: the client left (reset its socket) as planned, after the stream had started and
  sent at least one event with text;
* ``429``: refused with 429 and a ``Retry-After`` header (``--max-concurrency``);
* ``error``: anything else (another status, an error event, a broken or unfinished stream, a
  connection refused or reset, a timeout), with a one-line reason.

One command (64 streams, 8 tokens, half of the clients leave after their first token)::

    python benchmarks/load_client.py http://127.0.0.1:8000 --num 64 --max-tokens 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from urllib.parse import urlparse

OUTCOMES = ("ok", "aborted", "429", "error")


@dataclass
class LoadResult:
    """Outcomes of one wave of requests: ``counts`` per outcome (every one of :data:`OUTCOMES`),
    ``errors`` (one line each, at most the first 20 kept), wall ``seconds``."""

    counts: Counter = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def add(self, outcome: str, detail: str = "") -> None:
        self.counts[outcome] += 1
        if outcome == "error" and len(self.errors) < 20:
            self.errors.append(detail)

    def as_dict(self) -> dict:
        return {**{k: self.counts[k] for k in OUTCOMES}, "seconds": round(self.seconds, 2)}


def completion_body(index: int, max_tokens: int, ignore_eos: bool = True) -> bytes:
    """A streamed ``/v1/completions`` body with a prompt of a few tokens (it differs per
    ``index``) and the closing usage event."""
    body = {
        "prompt": f"Hi {index}",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return json.dumps(body).encode()


async def one_stream(
    host: str,
    port: int,
    body: bytes,
    leave_after: int | None,
    max_tokens: int | None,
    timeout_s: float,
    path: str = "/v1/completions",
) -> tuple[str, str]:
    """POST ``body`` (a streamed request) and judge the answer; returns ``(outcome, detail)``.

    ``leave_after``: close the socket after this many events with tokens (None: read to the
    end). ``max_tokens``: the token count an ``ok`` stream must have (None: any)."""
    try:
        return await asyncio.wait_for(
            _stream(host, port, body, leave_after, max_tokens, path), timeout_s
        )
    except (TimeoutError, asyncio.TimeoutError):
        return "error", f"no end within {timeout_s:.0f} s"
    except (OSError, asyncio.IncompleteReadError, ValueError) as e:
        return "error", f"{type(e).__name__}: {e}"


async def _stream(host, port, body, leave_after, max_tokens, path) -> tuple[str, str]:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(
            b"POST %s HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%s"
            % (path.encode(), host.encode(), len(body), body)
        )
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").lower()
        status = int(head.split(" ", 2)[1])
        if status != 200:
            text = await _body(reader, head)
            if status == 429 and "\r\nretry-after:" in head:
                return "429", ""
            return "error", f"HTTP {status}: {text[:200]!r}"
        if "transfer-encoding: chunked" not in head:
            return "error", f"a 200 that is not a chunked stream: {head[:200]!r}"
        return await _events(reader, writer, leave_after, max_tokens)
    finally:
        writer.close()


async def _events(reader, writer, leave_after, max_tokens) -> tuple[str, str]:
    """Read SSE events from a chunked body until ``[DONE]`` (or leave after ``leave_after``)."""
    buf = b""
    token_events = 0
    tokens = None  # the closing usage event's completion_tokens
    finish = None
    while True:
        size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
        data = await reader.readexactly(size + 2)
        if size == 0:
            return "error", f"the stream ended without [DONE] after {token_events} events"
        buf += data[:-2]
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            if not event.startswith(b"data: "):
                continue
            payload = event[6:]
            if payload == b"[DONE]":
                if finish is None:
                    return "error", "[DONE] without a finish_reason"
                if max_tokens is not None and finish == "length" and tokens != max_tokens:
                    return "error", f"usage counts {tokens} tokens, {max_tokens} asked"
                return "ok", finish
            chunk = json.loads(payload)
            if "error" in chunk:
                return "error", f"error event: {chunk['error'].get('message', '')[:200]}"
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices") or ():
                token_events += bool(choice.get("text"))
                finish = choice.get("finish_reason") or finish
            if leave_after is not None and token_events >= leave_after and finish is None:
                writer.transport.abort()  # leave now, as a client that goes away does
                return "aborted", ""


async def _body(reader, head: str) -> str:
    """The body of a non-streamed answer (content-length or chunked)."""
    for line in head.split("\r\n"):
        if line.startswith("content-length:"):
            return (await reader.readexactly(int(line.split(":")[1]))).decode(errors="replace")
    if "transfer-encoding: chunked" in head:
        out = b""
        while size := int((await reader.readuntil(b"\r\n"))[:-2], 16):
            out += (await reader.readexactly(size + 2))[:-2]
        return out.decode(errors="replace")
    return ""


async def run_wave(
    url: str,
    num: int,
    max_tokens: int,
    leave_every: int = 2,
    timeout_s: float = 300.0,
    first_index: int = 0,
    result: LoadResult | None = None,
) -> LoadResult:
    """``num`` streams started at once against ``url`` (``http://host:port``); every
    ``leave_every``-th one (0: none) leaves after its first token. Returns the outcomes (added
    to ``result`` as each request ends, when given: a reader sees them grow)."""
    parsed = urlparse(url)
    host, port = parsed.hostname, parsed.port or 80
    result = LoadResult() if result is None else result
    start = time.monotonic()

    async def one(i: int) -> None:
        leave = 1 if leave_every and i % leave_every == 0 else None
        body = completion_body(first_index + i, max_tokens)
        outcome, detail = await one_stream(host, port, body, leave, max_tokens, timeout_s)
        result.add(outcome, detail)

    await asyncio.gather(*(one(i) for i in range(num)))
    result.seconds += time.monotonic() - start
    return result


def raise_open_files_limit(needed: int) -> int:
    """Raise this process's soft limit of open files to at least ``needed`` (up to the hard
    limit); returns the soft limit now. One socket per stream, plus the interpreter's own."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    return soft


def main(argv: list[str] | None = None) -> dict:
    """Run one wave and print its outcomes as JSON; returns them."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("url", help="server or router, http://host:port")
    parser.add_argument("--num", type=int, default=64, help="concurrent streams (default: 64)")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens each (default: 8)")
    parser.add_argument(
        "--leave-every",
        type=int,
        default=2,
        help="every N-th client leaves after its first token; 0: none (default: 2)",
    )
    args = parser.parse_args(argv)
    raise_open_files_limit(args.num + 64)
    result = asyncio.run(run_wave(args.url, args.num, args.max_tokens, args.leave_every))
    out = {**result.as_dict(), "errors": result.errors}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    sys.exit(1 if main()["error"] else 0)
