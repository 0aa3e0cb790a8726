"""Publishers of KV-cache event batches: ZMQ PUB with a replay socket, or nothing.

Same wire protocol as vLLM v0.11.0's ``ZmqEventPublisher`` (``vllm/distributed/kv_events.py``):

* every batch is one PUB multipart message ``(topic, seq, payload)``: ``topic`` the UTF-8
  topic, ``seq`` the batch's sequence number as 8 bytes big-endian (0, 1, 2, ... per publisher),
  ``payload`` the msgpack of a :class:`~fastdeploy.distributed.kv_events.KVEventBatch`;
* the last ``buffer_steps`` batches are kept; a subscriber that sees a gap in ``seq`` sends the
  first missed ``seq`` (8 bytes big-endian) to the ROUTER ``replay_endpoint`` (from a REQ socket,
  or a DEALER with an empty delimiter frame first) and gets one ``(seq, payload)`` reply per
  buffered batch from that ``seq`` on, then ``(-1 as 8 signed bytes, b"")``. A DEALER that sends
  the bare ``seq`` frame gets the replies without the delimiter.

The engine hands batches over with :meth:`ZmqEventPublisher.publish` (a non-blocking put on a
bounded queue); a thread encodes and sends them and serves replay requests, so neither encoding
nor a slow or dead subscriber touches the step loop: PUB drops messages for a subscriber past
``hwm``, and a full queue drops the batch with an error in the log (never blocks).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

import msgspec

from fastdeploy.config.kv_events import KVEventsConfig
from fastdeploy.distributed.kv_events import EventBatch

logger = logging.getLogger(__name__)

#: The replay's end marker: seq -1 as 8 signed big-endian bytes (vLLM's ``END_SEQ``).
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class NullEventPublisher:
    """Drops every batch (``publisher: "null"``, and whenever events are off)."""

    def publish(self, batch: EventBatch) -> None:
        """Drop ``batch``."""

    def shutdown(self) -> None:
        """Nothing to stop."""


class ZmqEventPublisher:
    """PUB socket plus optional ROUTER replay socket, served by one daemon thread.

    Args:
        config: endpoints, ``buffer_steps``, ``hwm``, ``max_queue_size`` and ``topic``.
        data_parallel_rank: stamped on batches that carry none (0: one engine).

    Raises:
        zmq.ZMQError: an endpoint cannot be bound or connected (e.g. the port is in use); no
            socket or thread is left behind then.
    """

    SHUTDOWN_TIMEOUT_S = 1.0

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        import zmq

        self._zmq = zmq
        self._rank = data_parallel_rank
        self._topic = config.topic.encode("utf-8")
        self._queue: queue.Queue[EventBatch | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._next_seq = 0
        self.num_dropped = 0
        self._ctx = zmq.Context()
        self._pub = self._replay = None
        try:
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.set_hwm(config.hwm)
            endpoint = config.endpoint
            if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
                self._pub.bind(endpoint)
            else:
                self._pub.connect(endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(config.replay_endpoint)
        except BaseException:
            self._close_sockets()
            raise
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()
        logger.info(
            "KV events: publishing on %s (replay: %s, topic %r)",
            config.endpoint,
            config.replay_endpoint,
            config.topic,
        )

    @property
    def last_endpoint(self) -> str:
        """The PUB socket's resolved address (the port a ``tcp://*:0`` bind got)."""
        return self._pub.getsockopt_string(self._zmq.LAST_ENDPOINT)

    @property
    def last_replay_endpoint(self) -> str | None:
        """The replay socket's resolved address, or None without replay."""
        if self._replay is None:
            return None
        return self._replay.getsockopt_string(self._zmq.LAST_ENDPOINT)

    def publish(self, batch: EventBatch) -> None:
        """Queue ``batch`` for sending; never blocks (a full queue drops it, with an error).

        Raises:
            RuntimeError: the publisher was shut down.
        """
        if self._closed:
            raise RuntimeError("the KV event publisher is shut down")
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self._rank
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.num_dropped += 1
            logger.error(
                "KV events: the publisher's queue is full (max_queue_size=%d); dropped a batch "
                "of %d events (%d dropped so far): subscribers' view of the cache is now stale",
                self._queue.maxsize,
                len(batch.events),
                self.num_dropped,
            )

    def shutdown(self) -> None:
        """Send what is queued (up to ``SHUTDOWN_TIMEOUT_S``), stop the thread and close the
        sockets and the context. Idempotent."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + self.SHUTDOWN_TIMEOUT_S
        while True:
            try:
                self._queue.put(None, timeout=max(0.0, deadline - time.monotonic()))
                break
            except queue.Full:
                if time.monotonic() >= deadline:
                    self._stop = True  # the thread leaves without draining
                    break
        self._thread.join(max(0.1, deadline - time.monotonic()) + 0.5)
        if self._thread.is_alive():
            logger.warning("KV events: the publisher thread did not stop in time")
            return  # it still owns the sockets; the daemon thread dies with the process
        self._close_sockets()

    _stop = False

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()

    def _run(self) -> None:
        """The thread: send queued batches, serve replay requests between them."""
        encoder = msgspec.msgpack.Encoder()
        while not self._stop:
            if self._replay is not None:
                while self._replay.poll(0):
                    try:
                        self._serve_replay()
                    except Exception:
                        logger.exception("KV events: a replay request failed")
            try:
                batch = self._queue.get(timeout=0.02)
            except queue.Empty:
                continue
            if batch is None:
                return
            try:
                payload = encoder.encode(batch)
                seq = self._next_seq
                self._next_seq += 1
                # PUB never blocks: past hwm, ZMQ drops the message for that subscriber.
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
            except Exception:
                logger.exception("KV events: sending a batch failed")

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) == 3 and frames[1] == b"":
            client, envelope, start = frames[0], [b""], frames[2]
        elif len(frames) == 2:
            client, envelope, start = frames[0], [], frames[1]
        else:
            logger.warning("KV events: ignored a replay request of %d frames", len(frames))
            return
        if len(start) != 8:
            logger.warning("KV events: ignored a replay request for seq %r (not 8 bytes)", start)
            return
        first = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= first:
                self._replay.send_multipart([client, *envelope, seq.to_bytes(8, "big"), payload])
        self._replay.send_multipart([client, *envelope, END_SEQ, b""])


def make_event_publisher(
    config: KVEventsConfig | None, data_parallel_rank: int = 0
) -> NullEventPublisher | ZmqEventPublisher:
    """The publisher ``config`` asks for: ZMQ when events are on and ``publisher == "zmq"``,
    else the null publisher (vLLM's ``EventPublisherFactory.create``).

    Raises:
        zmq.ZMQError: see :class:`ZmqEventPublisher`.
    """
    if config is None or not config.publishes:
        return NullEventPublisher()
    return ZmqEventPublisher(config, data_parallel_rank)
