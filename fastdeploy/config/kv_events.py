"""KV-cache event publishing: :class:`KVEventsConfig` (``--kv-events-config``).

Field names, meanings and defaults are vLLM's (v0.11.0, ``vllm/config/kv_events.py``), so a
fleet layer's ``--kv-events-config`` JSON for vLLM works here unchanged. The wire format and the
publisher are in :mod:`fastdeploy.distributed.kv_events` and
:mod:`fastdeploy.distributed.kv_event_publisher`; ``docs/kv-events.md`` describes both.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastdeploy.config.checks import check, check_int, config_from_value

#: Publishers, as vLLM's ``EventPublisherFactory`` names them.
KV_EVENT_PUBLISHERS = ("null", "zmq")


@dataclass
class KVEventsConfig:
    """Where and how KV-cache events are published (vLLM v0.11.0's fields and defaults).

    Attributes:
        enable_kv_cache_events: collect ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``
            events in the KV cache manager and publish them once per engine step.
        publisher: ``"zmq"`` (PUB socket plus optional ROUTER replay socket) or ``"null"``
            (drops every batch). ``None`` (the default) resolves to ``"zmq"`` when events are
            enabled, else ``"null"``, as newer vLLM does (some releases defaulted to ``"null"``).
        endpoint: the PUB socket's ZMQ address; one with ``*`` or ``::`` (or ``ipc://`` /
            ``inproc://``) is bound, any other is connected to.
        replay_endpoint: the ROUTER socket's address (always bound) where a subscriber asks for
            the batches it missed; ``None``: no replay.
        buffer_steps: batches kept for replay (one batch per engine step with events).
        hwm: the PUB socket's send high-water mark (messages queued per slow subscriber before
            ZMQ drops them; the engine never blocks on a subscriber).
        max_queue_size: batches queued between the engine and the sending thread.
        topic: the first frame of every published message (subscribers filter on it).

    Raises:
        ValueError: a field of the wrong type or out of range, naming it and what is allowed.
    """

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        check(
            isinstance(self.enable_kv_cache_events, bool),
            "kv_events_config.enable_kv_cache_events",
            self.enable_kv_cache_events,
            "true or false",
        )
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        check(
            self.publisher in KV_EVENT_PUBLISHERS,
            "kv_events_config.publisher",
            self.publisher,
            ", ".join(KV_EVENT_PUBLISHERS),
        )
        for name in ("endpoint", "topic"):
            value = getattr(self, name)
            check(isinstance(value, str), f"kv_events_config.{name}", value, "a string")
        check(
            self.replay_endpoint is None or isinstance(self.replay_endpoint, str),
            "kv_events_config.replay_endpoint",
            self.replay_endpoint,
            "a ZMQ address string (e.g. tcp://*:5558) or null",
        )
        if self.publisher == "zmq":
            check(
                "://" in self.endpoint,
                "kv_events_config.endpoint",
                self.endpoint,
                "a ZMQ address such as tcp://*:5557, tcp://host:5557 or ipc:///path",
            )
            check(
                self.replay_endpoint is None or "://" in self.replay_endpoint,
                "kv_events_config.replay_endpoint",
                self.replay_endpoint,
                "a ZMQ address such as tcp://*:5558, or null",
            )
        check_int("kv_events_config.buffer_steps", self.buffer_steps)
        check_int("kv_events_config.hwm", self.hwm, minimum=0)
        check_int("kv_events_config.max_queue_size", self.max_queue_size)

    @property
    def publishes(self) -> bool:
        """Events are collected and a real (zmq) publisher sends them."""
        return self.enable_kv_cache_events and self.publisher != "null"

    @classmethod
    def from_value(cls, value: KVEventsConfig | dict | str | None) -> KVEventsConfig:
        """Build from a JSON object string (the CLI flag), a dict, ``None`` (defaults: events
        off) or an instance.

        Raises:
            ValueError: bad JSON, not an object, an unknown key (with close matches) or a bad
                field value.
        """
        return config_from_value(cls, value, "kv_events_config")
