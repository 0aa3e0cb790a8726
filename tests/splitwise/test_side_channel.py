"""The PD control side channel: JSON lines over TCP, errors that name what is wrong."""

from __future__ import annotations

import pytest
from splitwise_utils import free_port

from fastdeploy.splitwise.side_channel import SideChannelError, SideChannelServer, send_control


def test_round_trip_and_refusals():
    seen = []

    def handler(op, message):
        seen.append((op, message["request_ids"]))
        if op == "CLAIM" and message["request_ids"] == ["gone"]:
            raise KeyError("request 'gone' is not pending")
        return {"claimed": message["request_ids"]} if op == "CLAIM" else {}

    server = SideChannelServer("127.0.0.1", 0, handler).start()
    try:
        reply = send_control("127.0.0.1", server.port, "CLAIM", ["r1"])
        assert reply == {"ok": True, "claimed": ["r1"]}
        assert send_control("127.0.0.1", server.port, "ABORT", ["r1", "r2"]) == {"ok": True}
        with pytest.raises(SideChannelError, match="CLAIM .* refused: .*'gone' is not pending"):
            send_control("127.0.0.1", server.port, "CLAIM", ["gone"])
        assert seen == [("CLAIM", ["r1"]), ("ABORT", ["r1", "r2"]), ("CLAIM", ["gone"])]
    finally:
        server.close()


def test_bad_messages_are_refused_without_killing_the_channel():
    import socket

    server = SideChannelServer("127.0.0.1", 0, lambda op, m: {}).start()
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            lines = sock.makefile("rb")
            for raw, error in (
                (b"not json\n", "not a JSON line"),
                (b'{"op": "STEAL", "request_ids": []}\n', "op='STEAL' is invalid; allowed: CLAIM"),
                (b'{"op": "DONE", "request_ids": "r1"}\n', "request_ids='r1' is invalid"),
                (b"[" * 100_000 + b"\n", "not a JSON line"),  # deeper than json's recursion
            ):
                sock.sendall(raw)
                assert error in lines.readline().decode()
        assert send_control("127.0.0.1", server.port, "HEARTBEAT", ["r"]) == {"ok": True}
    finally:
        server.close()
    with pytest.raises(ValueError, match="op='STEAL' is invalid"):
        send_control("127.0.0.1", 1, "STEAL", [])


def test_a_silent_connection_is_closed_after_the_idle_timeout(monkeypatch):
    import socket
    import time

    from fastdeploy.splitwise import side_channel

    monkeypatch.setattr(side_channel._Connection, "timeout", 0.5)
    server = SideChannelServer("127.0.0.1", 0, lambda op, m: {}).start()
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            start = time.monotonic()
            assert sock.recv(1) == b""  # the server closed it
            assert time.monotonic() - start < 4
        assert send_control("127.0.0.1", server.port, "HEARTBEAT", ["r"]) == {"ok": True}
    finally:
        server.close()


def test_unreachable_peer_is_a_side_channel_error():
    with pytest.raises(SideChannelError, match=r"ABORT to 127.0.0.1:\d+ failed"):
        send_control("127.0.0.1", free_port(), "ABORT", ["r"], timeout_s=2)
