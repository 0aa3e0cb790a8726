"""A minimal streaming client of ``/v1/completions`` for ``benchmark_server_overhead.py``.

Raw HTTP/1.1 over asyncio streams (chunked responses only), reading only what it times: the
arrival of each token event. ``httpx`` (``benchmark_serving.py``'s client) spends about 70 us of
CPU per streamed chunk on a small host, which would make the client, not the server, the
bottleneck. Run as a process of its own::

    echo '[[1, 2, 3], [4, 5]]' | python benchmarks/sse_client.py http://127.0.0.1:8000 64 128

reads the prompts (JSON lists of token ids) from stdin and prints one JSON line of results.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time


async def stream_times(host: str, port: int, conn: list, body: bytes) -> list[float]:
    """POST ``body`` to /v1/completions over a kept-alive connection (``conn`` holds the reader
    and writer, opened on first use); returns the arrival time (``perf_counter`` seconds) of each
    event with a choice, one per token when every chunk adds one (``ignore_eos``).

    Raises:
        RuntimeError: the answer is not a 200.
    """
    if not conn:
        conn.extend(await asyncio.open_connection(host, port))
    reader, writer = conn
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (host.encode(), len(body), body)
    )
    head = await reader.readuntil(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"HTTP error: {head[:100]!r}")
    times = []
    while True:
        size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
        data = await reader.readexactly(size + 2)
        if size == 0:
            return times
        now = time.perf_counter()
        times.extend(now for _ in range(data.count(b'"choices": [{')))


def run_clients(url: str, prompts: list[list[int]], concurrency: int, max_tokens: int) -> dict:
    """``concurrency`` closed-loop streaming clients send ``prompts`` (token ids, ``ignore_eos``,
    ``max_tokens`` each); returns output tok/s, TPOT and ITL p50 (ms), tokens, seconds and this
    process's CPU seconds."""
    host, port = url.split("//")[1].split(":")
    tpots, itls, tokens, seconds = [], [], 0, 0.0

    async def main() -> None:
        nonlocal tokens, seconds
        queue = list(prompts)

        async def loop() -> None:
            nonlocal tokens
            conn: list = []
            while queue:
                body = json.dumps(
                    {
                        "prompt": queue.pop(0),
                        "max_tokens": max_tokens,
                        "temperature": 0,
                        "ignore_eos": True,
                        "stream": True,
                    }
                )
                times = await stream_times(host, int(port), conn, body.encode())
                tokens += len(times)
                itls.extend(b - a for a, b in zip(times, times[1:]))
                if len(times) > 1:
                    tpots.append((times[-1] - times[0]) / (len(times) - 1))
            conn[1].close()

        start = time.perf_counter()
        await asyncio.gather(*(loop() for _ in range(concurrency)))
        seconds = time.perf_counter() - start

    cpu = time.process_time()
    asyncio.run(main())
    return {"served_tok_s": tokens / seconds, "tpot_p50_ms": p50_ms(tpots),
            "itl_p50_ms": p50_ms(itls), "tokens": tokens, "seconds": seconds,
            "client_cpu_s": time.process_time() - cpu}  # fmt: skip


def p50_ms(values: list[float]) -> float:
    """The median of ``values`` (seconds) in milliseconds; 0 when empty."""
    return sorted(values)[len(values) // 2] * 1000 if values else 0.0


if __name__ == "__main__":
    url, concurrency, max_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    print(json.dumps(run_clients(url, json.loads(sys.stdin.read()), concurrency, max_tokens)))
