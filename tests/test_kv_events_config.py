"""--kv-events-config: vLLM's fields and defaults, JSON parsing and clear errors."""

from __future__ import annotations

import pytest

from fastdeploy.config import FDConfig, KVEventsConfig
from fastdeploy.engine.args_utils import EngineArgs


def test_defaults_are_vllms():
    c = KVEventsConfig()
    assert (c.enable_kv_cache_events, c.publisher, c.endpoint, c.replay_endpoint) == (
        False,
        "null",
        "tcp://*:5557",
        None,
    )
    assert (c.buffer_steps, c.hwm, c.max_queue_size, c.topic) == (10_000, 100_000, 100_000, "")
    assert not c.publishes


def test_json_flag_enables_zmq_by_default():
    c = KVEventsConfig.from_value('{"enable_kv_cache_events": true, "topic": "kv"}')
    assert c.publisher == "zmq" and c.topic == "kv" and c.publishes
    off = KVEventsConfig.from_value({"enable_kv_cache_events": True, "publisher": "null"})
    assert not off.publishes


@pytest.mark.parametrize(
    "value, message",
    [
        ("{not json", r"kv_events_config is not valid JSON"),
        ("[1]", r"kv_events_config=\[1\] is invalid; allowed: a JSON object"),
        (
            '{"enable_kv_cache_event": true}',
            r"unknown kv_events_config key .*did you mean "
            r"enable_kv_cache_events",
        ),
        ('{"publisher": "kafka"}', r"publisher='kafka' is invalid; allowed: null, zmq"),
        ('{"enable_kv_cache_events": 1}', r"enable_kv_cache_events=1 is invalid; allowed: true"),
        ('{"buffer_steps": 0}', r"buffer_steps=0 is invalid; allowed: an integer >= 1"),
        ('{"hwm": -1}', r"hwm=-1 is invalid; allowed: an integer >= 0"),
        ('{"enable_kv_cache_events": true, "endpoint": "5557"}', r"endpoint='5557' is invalid"),
    ],
)
def test_bad_values_name_the_field_and_what_is_allowed(value, message):
    with pytest.raises(ValueError, match=message):
        KVEventsConfig.from_value(value)


def test_cli_flag_reaches_fdconfig_and_round_trips():
    parser = EngineArgs.add_cli_args(__import__("argparse").ArgumentParser())
    ns = parser.parse_args(
        [
            "--kv-events-config",
            '{"enable_kv_cache_events": true, "endpoint": "tcp://*:6000"}',
            "--prefix-caching-hash-algo",
            "sha256_cbor",
        ]
    )
    args = EngineArgs.from_cli_args(ns)
    assert args.kv_events_config == {"enable_kv_cache_events": True, "endpoint": "tcp://*:6000"}
    assert args.prefix_caching_hash_algo == "sha256_cbor"
    config = FDConfig(kv_events_config=KVEventsConfig.from_value(args.kv_events_config))
    assert FDConfig.from_dict(config.to_dict()) == config
    with pytest.raises(SystemExit):
        parser.parse_args(["--prefix-caching-hash-algo", "md5"])


def test_events_without_prefix_caching_warn_as_vllm_does(caplog):
    import argparse

    from fastdeploy.model_executor.model_loader.source import ModelSource

    src = ModelSource("unused", None, "dummy", argparse.Namespace(max_position_embeddings=64), "x")
    args = EngineArgs(
        enable_prefix_caching=False, kv_events_config='{"enable_kv_cache_events": true}'
    )
    with caplog.at_level("WARNING"):
        config = args.create_engine_config(src)
    assert config.kv_events_config.enable_kv_cache_events
    assert "prefix caching is off" in caplog.text
    caplog.clear()
    EngineArgs(kv_events_config='{"enable_kv_cache_events": true}').create_engine_config(src)
    assert "prefix caching is off" not in caplog.text
