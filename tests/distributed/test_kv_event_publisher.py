"""The ZMQ KV-event publisher: (topic, seq, msgpack) messages with consecutive seqs, decodable
by a subscriber's own structs; replay of buffered batches; sockets closed on shutdown."""

from __future__ import annotations

import time

import pytest
import zmq
from kv_event_subscriber import DECODER, Subscriber

from fastdeploy.config import KVEventsConfig
from fastdeploy.distributed.kv_event_publisher import (
    NullEventPublisher,
    ZmqEventPublisher,
    make_event_publisher,
)
from fastdeploy.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch


@pytest.fixture
def sub():
    s = Subscriber("kv")
    try:
        yield s
    finally:
        s.close()


def config(endpoint: str, **kw) -> KVEventsConfig:
    return KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=endpoint,
        replay_endpoint="tcp://127.0.0.1:0",
        topic="kv",
        **kw,
    )


def batch(i: int) -> KVEventBatch:
    return KVEventBatch(
        float(i),
        [BlockStored([i, i + 1], None, [1, 2, 3, 4], 2, None, "GPU"), BlockRemoved([i], "CPU")],
    )


def test_seqs_payloads_and_replay(sub):
    pub = ZmqEventPublisher(config(sub.endpoint, buffer_steps=8))
    try:
        sub.wait_connected(lambda: pub.publish(KVEventBatch(0.0, [])))
        first = max(sub.received) + 1
        for i in range(12):
            pub.publish(batch(i))
        sub.drain()
        seqs = sorted(s for s in sub.received if s >= first)
        assert seqs == list(range(first, first + 12))  # consecutive
        decoded = [DECODER.decode(sub.received[s]) for s in seqs]
        assert [b.ts for b in decoded] == [float(i) for i in range(12)]
        e = decoded[3].events
        assert (e[0].block_hashes, e[0].parent_block_hash, e[0].token_ids, e[0].medium) == (
            [3, 4],
            None,
            [1, 2, 3, 4],
            "GPU",
        )
        assert (type(e[1]).__name__, e[1].block_hashes, e[1].medium) == ("BlockRemoved", [3], "CPU")
        # Only the last buffer_steps=8 batches are kept: a replay from `first` gets those.
        last = first + 11
        replayed = sub.replay(pub.last_replay_endpoint, first)
        assert sorted(replayed) == list(range(last - 7, last + 1))
        assert all(replayed[s] == sub.received[s] for s in replayed)  # the same bytes
        assert sub.replay(pub.last_replay_endpoint, last) == {last: sub.received[last]}
        assert sub.replay(pub.last_replay_endpoint, last + 1) == {}
    finally:
        pub.shutdown()


def test_shutdown_closes_the_sockets(sub):
    pub = ZmqEventPublisher(config(sub.endpoint))
    replay = pub.last_replay_endpoint
    pub.shutdown()
    pub.shutdown()  # idempotent
    with pytest.raises(RuntimeError, match="shut down"):
        pub.publish(batch(0))
    ctx = zmq.Context()
    s = ctx.socket(zmq.ROUTER)
    try:
        s.bind(replay)  # the port is free again
    finally:
        s.close(linger=0)
        ctx.term()


def test_no_subscriber_never_blocks_the_engine():
    pub = ZmqEventPublisher(
        KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:1", hwm=1)
    )  # connects to a port where nothing listens
    try:
        start = time.monotonic()
        for i in range(2000):
            pub.publish(batch(i))
        assert time.monotonic() - start < 1.0
    finally:
        pub.shutdown()


def test_factory_picks_the_null_publisher_when_off():
    assert isinstance(make_event_publisher(None), NullEventPublisher)
    assert isinstance(make_event_publisher(KVEventsConfig()), NullEventPublisher)
    off = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    assert isinstance(make_event_publisher(off), NullEventPublisher)
