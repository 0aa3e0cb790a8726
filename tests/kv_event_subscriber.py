"""A KV-event subscriber for tests, written from vLLM's wire format (v0.11.0, as its example
``examples/online_serving/kv_events_subscriber.py`` describes it) with its OWN msgspec structs:
it shares no code with the engine's publisher, so it checks the format, not our classes."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import zmq


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(KVEventBatch)


class Subscriber:
    """A SUB socket BOUND on 127.0.0.1 (a free port; the publisher connects to it) and a
    DEALER for replay requests. ``received``: seq -> raw payload, in arrival order."""

    def __init__(self, topic: str = "") -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.sub.bind("tcp://127.0.0.1:0")
        self.endpoint = self.sub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.topic = topic.encode()
        self.received: dict[int, bytes] = {}
        self.replay_sock = None

    def drain(self, timeout_ms: int = 300) -> None:
        """Receive until nothing came for ``timeout_ms``."""
        while self.sub.poll(timeout_ms):
            topic, seq, payload = self.sub.recv_multipart()
            assert topic == self.topic
            self.received[int.from_bytes(seq, "big")] = payload

    def wait_connected(self, publish, timeout_s: float = 10.0) -> None:
        """PUB drops messages until this SUB's subscription reached it (ZMQ's slow joiner):
        ``publish()`` an empty batch every 50 ms until one arrives."""
        deadline = time.monotonic() + timeout_s
        while not self.received:
            assert time.monotonic() < deadline, "the subscriber never connected"
            publish()
            self.drain(50)

    def replay(self, endpoint: str, start: int, timeout_ms: int = 5000) -> dict[int, bytes]:
        """Ask for every buffered batch from ``start`` on; seq -> payload, up to the end marker."""
        if self.replay_sock is None:
            self.replay_sock = self.ctx.socket(zmq.DEALER)
            self.replay_sock.connect(endpoint)
        self.replay_sock.send_multipart([b"", start.to_bytes(8, "big")])
        got = {}
        while True:
            assert self.replay_sock.poll(timeout_ms), "no replay answer"
            empty, seq, payload = self.replay_sock.recv_multipart()
            assert empty == b""
            if int.from_bytes(seq, "big", signed=True) == -1:
                assert payload == b""
                return got
            got[int.from_bytes(seq, "big")] = payload

    def close(self) -> None:
        for s in (self.sub, self.replay_sock):
            if s is not None:
                s.close(linger=0)
        self.ctx.term()


def apply(view: dict[str, set[int]], batch: KVEventBatch) -> None:
    """Apply one batch to a router's view: medium -> stored block hashes."""
    for e in batch.events:
        if isinstance(e, BlockStored):
            view.setdefault(e.medium, set()).update(e.block_hashes)
        elif isinstance(e, BlockRemoved):
            view.setdefault(e.medium, set()).difference_update(e.block_hashes)
        else:
            view.clear()
