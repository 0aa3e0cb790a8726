"""Fake OpenAI servers that record what reaches them, and an in-thread uvicorn for any app."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, StreamingResponse


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve(app: FastAPI) -> Iterator[str]:
    """Serve ``app`` at 127.0.0.1:<free port> on a thread; yields its URL; stops it after."""
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "in-thread server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        assert not thread.is_alive(), "in-thread server did not stop"


def fake_server(name: str, kv_params: dict | None = None, fail_status: int | None = None):
    """A fake OpenAI server called ``name``.

    It records ``(path, headers, body)`` of every POST in ``app.state.seen`` and answers a
    completion whose text is ``name``; streamed as two SSE chunks and ``[DONE]`` when asked.
    ``kv_params`` is added as ``kv_transfer_params`` (a prefill node); ``fail_status`` makes
    every POST answer that status; ``app.state.healthy`` drives ``/health``.
    """
    app = FastAPI()
    app.state.seen = []
    app.state.healthy = True

    @app.get("/health")
    async def health():
        return JSONResponse({}, status_code=200 if app.state.healthy else 503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model"}]}

    async def answer(raw: HTTPRequest):
        body = await raw.json()
        app.state.seen.append((raw.url.path, dict(raw.headers), body))
        if fail_status is not None:
            return JSONResponse(
                {"error": {"message": f"{name} refused", "type": "x"}}, status_code=fail_status
            )
        if body.get("stream"):

            def chunks():
                for piece in (name[:2], name[2:]):
                    yield f"data: {json.dumps({'text': piece})}\n\n".encode()
                yield b"data: [DONE]\n\n"

            return StreamingResponse(chunks(), media_type="text/event-stream")
        reply = {"id": "x", "object": "text_completion", "choices": [{"text": name}]}
        if kv_params is not None:
            reply["kv_transfer_params"] = kv_params
        return reply

    app.post("/v1/completions")(answer)
    app.post("/v1/chat/completions")(answer)
    return app


def dying_stream_server():
    """A server whose stream sends one chunk, then drops the connection (a killed backend)."""
    import asyncio

    app = FastAPI()

    @app.get("/health")
    async def health():
        return {}

    @app.post("/v1/completions")
    async def answer(raw: HTTPRequest):
        await raw.json()

        async def chunks():
            yield b'data: {"text": "partial"}\n\n'
            await asyncio.sleep(0.05)
            raise RuntimeError("backend died")  # uvicorn drops the connection mid-body

        return StreamingResponse(chunks(), media_type="text/event-stream")

    return app


def stalling_server(stall_s: float = 30.0):
    """A server that sends its headers (200) and then nothing for ``stall_s`` seconds, streamed
    or not (a backend that froze mid-answer). ``app.state.release`` ends the stall early."""
    import asyncio

    app = FastAPI()
    app.state.release = None

    @app.get("/health")
    async def health():
        return {}

    @app.post("/v1/completions")
    async def answer(raw: HTTPRequest):
        body = await raw.json()
        release = app.state.release = asyncio.Event()

        async def chunks():
            if body.get("stream"):
                yield b'data: {"text": "partial"}\n\n'
            else:
                yield b'{"id": "x", '  # the start of a JSON answer, never finished
            try:
                await asyncio.wait_for(release.wait(), stall_s)
            except asyncio.TimeoutError:
                pass

        media = "text/event-stream" if body.get("stream") else "application/json"
        return StreamingResponse(chunks(), media_type=media)

    return app
