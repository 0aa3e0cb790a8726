"""KV-cache events end to end: an in-process engine (tiny random-weight Llama on CPU, a small KV
pool) publishes on ZMQ to a subscriber that decodes with its own structs
(``tests/kv_event_subscriber.py``). After random prefix-cache workloads with evictions, the
subscriber's stored hashes equal the engine's cache (device tier, and the host tier with medium
"CPU"), sequence numbers are consecutive from 0, a replay returns exactly the batches from the
asked seq on, and the hashes of first blocks are what a router recomputes from the token ids."""

from __future__ import annotations

import hashlib
import json
import pickle
import random

import pytest
import zmq
from kv_event_subscriber import DECODER, BlockRemoved, BlockStored, Subscriber, apply
from tiny_models import tiny_llama

from fastdeploy.cache_manager import block_hash
from fastdeploy.cache_manager.block_hash import external_block_hash
from fastdeploy.core.sampling_params import SamplingParams
from fastdeploy.distributed.kv_events import KVEventBatch
from fastdeploy.engine.args_utils import EngineArgs
from fastdeploy.engine.engine import LLMEngine

BLOCK = 16
SEED = "4242"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_llama_kv_events")
    (d / "config.json").write_text(json.dumps(tiny_llama(num_hidden_layers=2)))
    return str(d)


@pytest.fixture
def sub(monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", SEED)
    block_hash.init_none_hash("sha256")  # NONE_HASH from the seed, as a router shares it
    s = Subscriber("fd")
    try:
        yield s
    finally:
        s.close()
        monkeypatch.delenv("PYTHONHASHSEED")
        block_hash.init_none_hash("sha256")


def start_engine(tiny_dir, sub: Subscriber, **kw) -> LLMEngine:
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": sub.endpoint,  # no "*": the publisher connects to the bound subscriber
        "replay_endpoint": "tcp://127.0.0.1:0",
        "topic": "fd",
    }
    args = dict(
        model=tiny_dir,
        load_format="dummy",
        skip_tokenizer_init=True,
        max_model_len=256,
        block_size=BLOCK,
        max_num_seqs=4,
        num_gpu_blocks_override=14,  # 13 usable blocks: the workload must evict
        seed=0,
        device="cpu",
        kv_events_config=json.dumps(events),
    )
    args.update(kw)
    eng = LLMEngine.from_engine_args(EngineArgs(**args))
    try:
        # Empty batches until the subscription reached the publisher (a router connects long
        # before the workload; these count as batches, seq 0 on).
        sub.wait_connected(lambda: eng.kv_event_publisher.publish(KVEventBatch(0.0, [])))
    except BaseException:
        eng.shutdown()
        raise
    return eng


def workload(eng: LLMEngine, seed: int, n: int = 16) -> list[list[int]]:
    """Prompts over three shared prefixes, two or three at a time, stepped to the end (and
    until host-tier copies settled); returns each request's prompt + output tokens."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 500) for _ in range(rng.choice((20, 40, 64)))] for _ in range(3)]
    params = SamplingParams(temperature=0, max_tokens=rng.randrange(4, 20), ignore_eos=True)
    i = 0
    tokens: dict[str, list[int]] = {}
    while i < n:
        for _ in range(rng.choice((2, 3))):
            tail = [rng.randrange(3, 500) for _ in range(rng.randrange(0, 40))]
            tokens[f"r{seed}-{i}"] = rng.choice(prefixes) + tail
            eng.add_request(f"r{seed}-{i}", tokens[f"r{seed}-{i}"], params)
            i += 1
        for _ in range(1000):
            if not (eng.has_unfinished_requests() or eng.has_background_work()):
                break
            for out in eng.step():
                tokens[out.request_id] += out.new_token_ids
            eng.check_integrity()
        else:
            raise AssertionError("the workload did not finish")
    return list(tokens.values())


def router_chain(token_ids: list[int]) -> list[int]:
    """vLLM's chain from NONE_HASH = sha256(pickle(PYTHONHASHSEED)), as a router computes it."""

    def digest(obj) -> bytes:
        return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()

    parent, out = digest(SEED), []
    for i in range(len(token_ids) // BLOCK):
        parent = digest((parent, tuple(token_ids[i * BLOCK : (i + 1) * BLOCK]), None))
        out.append(int.from_bytes(parent[-8:], "big"))
    return out


def collect(eng: LLMEngine, sub: Subscriber) -> list:
    """Every batch the engine published, in seq order (a replay from seq 0, which also returns
    the probes sent before the subscription reached the publisher). Checks that the SUB got
    consecutive seqs after its first and replay exactness on the way."""
    eng.publish_kv_events()
    sub.drain()
    assert sub.received, "the subscriber got nothing"
    replay_endpoint = eng.kv_event_publisher.last_replay_endpoint
    replayed = sub.replay(replay_endpoint, 0)
    last = max(sub.received)
    assert sorted(sub.received) == list(range(min(sub.received), last + 1))  # consecutive
    assert sorted(replayed) == list(range(last + 1))  # consecutive, nothing lost
    assert all(replayed[s] == sub.received[s] for s in sub.received)  # same bytes
    # A subscriber that missed seqs k..k+2 asks from k and gets exactly the batches from k on.
    k = last // 2
    again = sub.replay(replay_endpoint, k)
    assert sorted(again) == list(range(k, last + 1))
    assert [again[s] for s in (k, k + 1, k + 2) if s <= last] == [
        replayed[s] for s in (k, k + 1, k + 2) if s <= last
    ]
    return [DECODER.decode(replayed[s]) for s in range(last + 1)]


def check_first_blocks(batches, medium: str) -> int:
    """Every stored run that starts a sequence hashes as a router recomputes it."""
    checked = 0
    for b in batches:
        for e in b.events:
            if isinstance(e, BlockStored) and e.medium == medium and e.parent_block_hash is None:
                assert e.block_hashes == router_chain(e.token_ids)
                checked += 1
    return checked


@pytest.mark.parametrize("seed", [0, 1])
def test_subscriber_view_equals_device_cache(tiny_dir, sub, seed):
    eng = start_engine(tiny_dir, sub)
    try:
        sequences = workload(eng, seed)
        batches = collect(eng, sub)
        view: dict[str, set[int]] = {}
        for b in batches:
            apply(view, b)
        cache = eng.kv_cache_manager.prefix_cache
        assert cache.cached_hashes(), "nothing cached"
        assert view["GPU"] == {external_block_hash(h) for h in cache.cached_hashes()}
        assert set(view) == {"GPU"}
        removed = [e for b in batches for e in b.events if isinstance(e, BlockRemoved)]
        assert removed, "the workload evicted nothing"
        assert check_first_blocks(batches, "GPU") > 0
        # Every published hash, generated tokens' blocks included, is one a router computes
        # from some request's prompt + output tokens.
        routed = {h for seq in sequences for h in router_chain(seq)}
        assert view["GPU"] <= routed
        # A reset clears the cache and tells the subscriber at once.
        assert eng.reset_prefix_cache()
        sub.drain()
        last = DECODER.decode(sub.received[max(sub.received)])
        assert [type(e).__name__ for e in last.events] == ["AllBlocksCleared"]
    finally:
        replay_endpoint = eng.kv_event_publisher.last_replay_endpoint
        eng.shutdown()
    assert eng.kv_event_publisher is None
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    try:
        sock.bind(replay_endpoint)  # shutdown closed the publisher's sockets: the port is free
    finally:
        sock.close(linger=0)
        ctx.term()


def test_host_tier_events_carry_medium_cpu(tiny_dir, sub):
    # About 17 host blocks of this model's 12,288 bytes: the host tier evicts too.
    eng = start_engine(tiny_dir, sub, swap_space=0.0002, host_store_policy="all")
    try:
        workload(eng, 3, n=18)
        batches = collect(eng, sub)
        view: dict[str, set[int]] = {}
        for b in batches:
            apply(view, b)
        device = eng.kv_cache_manager.prefix_cache.cached_hashes()
        host = eng.host_tier.host.published_hashes()
        assert host, "nothing reached the host tier"
        assert view["GPU"] == {external_block_hash(h) for h in device}
        assert view["CPU"] == {external_block_hash(h) for h in host}
        cpu_removed = [
            e
            for b in batches
            for e in b.events
            if isinstance(e, BlockRemoved) and e.medium == "CPU"
        ]
        assert cpu_removed, "the host tier evicted nothing"
        assert check_first_blocks(batches, "CPU") > 0
        assert not eng.reset_prefix_cache()  # refused with a host tier
    finally:
        eng.shutdown()
