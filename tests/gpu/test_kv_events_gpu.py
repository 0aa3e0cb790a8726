"""KV-cache events on CUDA with the real default model and CUDA graphs.

Shared-prefix prompts run through an engine with a small pool, so blocks are evicted, with and
without the host tier. Afterwards a subscriber, using its own structs, holds exactly the
engine's cached hashes per medium, and replay returns every batch. A prompt answered from the
prefix cache gives the same greedy tokens as its cold run, and the decode steps ran as full
graphs.
"""

from __future__ import annotations

import json
import random

import pytest
from kv_event_subscriber import DECODER, Subscriber, apply

from fastdeploy.cache_manager import block_hash
from fastdeploy.cache_manager.block_hash import external_block_hash
from fastdeploy.core.sampling_params import SamplingParams
from fastdeploy.distributed.kv_events import KVEventBatch
from fastdeploy.engine.args_utils import EngineArgs
from fastdeploy.engine.engine import LLMEngine

BLOCK = 16


@pytest.fixture
def sub(monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "3")
    block_hash.init_none_hash("sha256")
    s = Subscriber("gpu")
    try:
        yield s
    finally:
        s.close()
        monkeypatch.delenv("PYTHONHASHSEED")
        block_hash.init_none_hash("sha256")


def run(eng: LLMEngine, prompts: dict[str, list[int]], max_tokens: int) -> dict[str, list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    out = {rid: [] for rid in prompts}
    for rid, ids in prompts.items():
        eng.add_request(rid, ids, params)
    for _ in range(5000):
        if not (eng.has_unfinished_requests() or eng.has_background_work()):
            return out
        for o in eng.step():
            out[o.request_id] += o.new_token_ids
        eng.check_integrity()
    raise AssertionError("the requests did not finish")


@pytest.mark.parametrize("swap_space", [0, 0.05], ids=["device", "host-tier"])
def test_subscriber_view_equals_the_caches_on_cuda(real_gguf, sub, swap_space):
    events = {
        "enable_kv_cache_events": True,
        "endpoint": sub.endpoint,
        "replay_endpoint": "tcp://127.0.0.1:0",
        "topic": "gpu",
    }
    eng = LLMEngine.from_engine_args(
        EngineArgs(
            model=real_gguf,
            dtype="bfloat16",
            device="cuda",
            seed=0,
            block_size=BLOCK,
            max_model_len=1024,
            max_num_seqs=4,
            num_gpu_blocks_override=40,
            swap_space=swap_space,
            kv_events_config=json.dumps(events),
            # graphs before the first step: the test counts replayed steps (issue #47)
            graph_optimization_config={"capture_in_background": False},
        )
    )
    try:
        sub.wait_connected(lambda: eng.kv_event_publisher.publish(KVEventBatch(0.0, [])))
        rng = random.Random(0)
        prefixes = [[rng.randrange(100, 40000) for _ in range(96)] for _ in range(3)]
        probe = prefixes[0] + [rng.randrange(100, 40000) for _ in range(7)]
        cold = run(eng, {"cold": probe}, 24)["cold"]
        for wave in range(6):
            run(
                eng,
                {
                    f"w{wave}-{i}": rng.choice(prefixes)
                    + [rng.randrange(100, 40000) for _ in range(rng.randrange(1, 60))]
                    for i in range(3)
                },
                16,
            )
        run(eng, {"last": prefixes[0] + [7]}, 4)  # the probe's prefix is the most recent
        before = eng.get_stats()
        warm = run(eng, {"warm": probe}, 24)["warm"]
        after = eng.get_stats()
        hits = sum(
            after.get(k, 0) - before.get(k, 0)
            for k in ("prefix_cache_hits", "host_cache_hit_tokens")
        )
        assert hits >= 96 - BLOCK, (before, after)
        assert warm == cold  # the prefix-hit path answers as the cold one, greedy
        eng.publish_kv_events()
        sub.drain()
        replayed = sub.replay(eng.kv_event_publisher.last_replay_endpoint, 0)
        last = max(sub.received)
        assert sorted(replayed) == list(range(last + 1))
        view: dict[str, set[int]] = {}
        removed = 0
        for seq in range(last + 1):
            batch = DECODER.decode(replayed[seq])
            removed += sum(type(e).__name__ == "BlockRemoved" for e in batch.events)
            apply(view, batch)
        device = {external_block_hash(h) for h in eng.kv_cache_manager.prefix_cache.cached_hashes()}
        assert view.get("GPU", set()) == device and device
        assert removed > 0  # the pool evicted
        if swap_space:
            host = {external_block_hash(h) for h in eng.host_tier.host.published_hashes()}
            assert view.get("CPU", set()) == host and host
        modes = eng.get_stats()["steps_by_mode"]
        assert modes.get("full", 0) > 0, modes
        print(
            f"swap_space={swap_space}: {last + 1} batches, {len(device)} GPU blocks, "
            f"{len(view.get('CPU', ()))} CPU blocks, {removed} removals, modes {modes}"
        )
    finally:
        eng.shutdown()
