"""KV-cache events recorded by the cache manager and the host tier: a subscriber that applies them
holds exactly the cache's hashes, after random workloads with evictions."""

from __future__ import annotations

import random

import pytest

from fastdeploy.cache_manager.block_hash import external_block_hash
from fastdeploy.cache_manager.host_cache import HostPrefixCache
from fastdeploy.cache_manager.kv_cache_manager import KVCacheManager
from fastdeploy.core.request import Request
from fastdeploy.core.sampling_params import SamplingParams
from fastdeploy.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

BS = 4


def apply(view: dict[str, set[int]], events) -> None:
    """A subscriber's view: medium -> stored hashes."""
    for e in events:
        if isinstance(e, BlockStored):
            assert e.block_size == BS and e.lora_id is None
            assert len(e.token_ids) in (0, BS * len(e.block_hashes))
            new = set(e.block_hashes)
            assert not new & view.setdefault(e.medium, set()), "stored twice"
            view[e.medium] |= new
        elif isinstance(e, BlockRemoved):
            gone = set(e.block_hashes)
            assert gone <= view.get(e.medium, set()), "removed a block never stored"
            view[e.medium] -= gone
        else:
            assert isinstance(e, AllBlocksCleared)
            view.clear()


def device_view(kv: KVCacheManager) -> set[int]:
    return {external_block_hash(h) for h in kv.prefix_cache.cached_hashes()}


def run(kv: KVCacheManager, r: Request) -> bool:
    """Admit, prefill and free one request; False when the pool cannot hold it now."""
    kv.get_computed_blocks(r)
    n = r.num_tokens - r.num_computed_tokens
    if not kv.allocate_slots(r, n):
        kv.free(r)
        return False
    r.num_computed_tokens += n
    kv.cache_full_blocks(r, r.num_computed_tokens)
    return True


@pytest.mark.parametrize("seed", range(5))
def test_subscriber_view_equals_cache_after_random_workload(seed):
    rng = random.Random(seed)
    kv = KVCacheManager(12, BS, enable_kv_cache_events=True)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(4, 14))] for _ in range(4)]
    view: dict[str, set[int]] = {}
    live: list[Request] = []
    removed = 0
    for i in range(60):
        tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(0, 9))]
        r = Request(f"r{i}", tokens, SamplingParams(max_tokens=4))
        if run(kv, r):
            live.append(r)
        while live and (len(live) > 2 or rng.random() < 0.5):
            kv.free(live.pop(rng.randrange(len(live))))
        events = kv.take_events()
        removed += sum(isinstance(e, BlockRemoved) for e in events)
        apply(view, events)
        assert view.get("GPU", set()) == device_view(kv)
        kv.check_integrity([x.block_ids for x in live])
    assert removed > 0  # the workload evicted


def test_one_stored_event_per_run_with_its_parent():
    kv = KVCacheManager(17, BS, enable_kv_cache_events=True)
    a = Request("a", list(range(10)), SamplingParams(max_tokens=8))
    kv.get_computed_blocks(a)
    assert kv.allocate_slots(a, 10)
    a.num_computed_tokens = 10
    kv.cache_full_blocks(a, 10)
    (first,) = kv.take_events()
    assert first.token_ids == list(range(8)) and len(first.block_hashes) == 2
    a.output_token_ids.extend([99, 98])  # 12 tokens: a third full block
    assert kv.allocate_slots(a, 2)
    a.num_computed_tokens = 12
    kv.cache_full_blocks(a, 12)
    (third,) = kv.take_events()
    assert third.parent_block_hash == first.block_hashes[-1]
    assert third.token_ids == [8, 9, 99, 98]
    assert kv.take_events() == []


def test_reset_prefix_cache_clears_only_unused_cache():
    kv = KVCacheManager(9, BS, enable_kv_cache_events=True)
    a = Request("a", list(range(9)), SamplingParams(max_tokens=8))
    assert run(kv, a)
    kv.take_events()
    assert not kv.reset_prefix_cache()  # a still uses its cached blocks
    assert kv.take_events() == []
    kv.free(a)
    assert kv.reset_prefix_cache()
    assert kv.take_events() == [AllBlocksCleared()]
    assert len(kv.prefix_cache) == 0 and kv.num_free_blocks == 8
    kv.check_integrity([])


def test_events_off_records_nothing():
    kv = KVCacheManager(9, BS)
    assert run(kv, Request("a", list(range(9)), SamplingParams(max_tokens=8)))
    assert not kv.records_events and kv.take_events() == []


def test_host_cache_records_evictions_of_published_blocks_only():
    cache = HostPrefixCache(1, record_evictions=True)
    cache.publish(cache.reserve(b"a"))
    assert cache.published_hashes() == {b"a"}
    cache.reserve(b"b")  # evicts a
    assert cache.take_evicted() == [b"a"] and cache.take_evicted() == []
    assert cache.published_hashes() == set()  # b is still storing
