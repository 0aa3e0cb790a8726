"""A simulated serving run: many random requests, a fake model runner that checks the KV content.

The fake runner keeps one token id per KV slot. Each step it checks that every context token a
scheduled request reads is in its block table's slots (so prefix-cache hits and preemption give
correct context), that it only writes blocks no one else holds, then writes the new tokens.
Sampled tokens depend only on (request, position), so outputs must not depend on batching or
preemption.
"""

import random

import pytest

from fastdeploy.cache_manager.kv_cache_manager import KVCacheManager
from fastdeploy.config import SchedulerConfig
from fastdeploy.core.request import Request, RequestStatus
from fastdeploy.core.sampling_params import SamplingParams
from fastdeploy.core.scheduler_output import SchedulerOutput
from fastdeploy.scheduler.scheduler import Scheduler

BS = 4
MAX_MODEL_LEN = 96


def fake_token(request_id: str, position: int) -> int:
    return 5000 + (sum(map(ord, request_id)) * 7919 + position * 31) % 3000


class FakeRunner:
    """Token ids per KV slot; reads and writes through block tables like attention would."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.slots: dict[int, list[int | None]] = {}

    def execute(self, out: SchedulerOutput) -> dict[str, int]:
        sampled = {}
        for s in out.scheduled:
            r, start, n = s.request, s.num_computed_tokens, s.num_new_tokens
            tokens = r.all_token_ids
            assert start + n <= len(tokens)
            assert len(r.block_ids) * BS >= start + n, "block table too short"
            for p in range(start):
                block = self.slots.get(r.block_ids[p // BS])
                assert block is not None and block[p % BS] == tokens[p], (r.request_id, p)
            for p in range(start, start + n):
                block_id = r.block_ids[p // BS]
                assert self.kv.block_pool.ref_count(block_id) == 1, "write into a shared block"
                self.slots.setdefault(block_id, [None] * BS)[p % BS] = tokens[p]
            if s.samples:
                sampled[r.request_id] = fake_token(r.request_id, len(tokens))
        return sampled


def run(chunked: bool, prefix: bool, seed: int) -> tuple[list[Request], dict]:
    rng = random.Random(seed)
    budget = 32 if chunked else MAX_MODEL_LEN
    config = SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=budget, enable_chunked_prefill=chunked
    )
    kv = KVCacheManager(num_blocks=41, block_size=BS, enable_prefix_caching=prefix)
    sched = Scheduler(config, kv, max_model_len=MAX_MODEL_LEN)
    runner = FakeRunner(kv)
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(4, 30))] for _ in range(4)]
    pending = []
    for i in range(80):
        tokens = rng.choice(prefixes)[:] if rng.random() < 0.5 else []
        tokens += [rng.randrange(1000) for _ in range(rng.randrange(1, 50))]
        max_tokens = rng.randrange(1, 40)
        pending.append(Request(f"req-{i}", tokens, SamplingParams(max_tokens=max_tokens)))
    requests = list(pending)
    stats = {"preemptions": 0, "cache_hits": 0, "aborted": set(), "steps": 0}
    while pending or sched.has_unfinished_requests():
        stats["steps"] += 1
        assert stats["steps"] < 5000, "no progress"
        for _ in range(rng.randrange(0, 3)):
            if pending:
                sched.add_request(pending.pop(0))
        if rng.random() < 0.02 and sched.has_unfinished_requests():
            victim = rng.choice(list(sched.running) + list(sched.waiting))
            assert sched.abort_request(victim.request_id)
            stats["aborted"].add(victim.request_id)
        running_before = {id(r) for r in sched.running}
        out = sched.schedule()
        stats["preemptions"] += len(out.preempted)
        assert out.num_batched_tokens <= budget
        assert len(out.scheduled) <= 8
        was_running = [id(s.request) in running_before for s in out.scheduled]
        assert was_running == sorted(was_running, reverse=True), "running requests go first"
        stats["cache_hits"] += sum(
            1
            for s, old in zip(out.scheduled, was_running, strict=True)
            if not old and s.request.num_cached_tokens
        )
        sampled = runner.execute(out)
        for r in sched.update_from_output(out, sampled):
            if (
                len(r.output_token_ids) >= r.sampling_params.max_tokens
                or r.num_tokens >= MAX_MODEL_LEN
            ):
                sched.finish_request(r, RequestStatus.FINISHED_LENGTH)
        sched.check_integrity()
    # No leak: only evictable prefix-cache blocks stay used, and they count as free.
    kv.check_integrity([])
    assert kv.num_free_blocks == kv.num_usable_blocks
    cached = len(kv.prefix_cache) if prefix else 0
    assert kv.block_pool.num_used == cached
    return requests, stats


@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("prefix", [True, False])
@pytest.mark.parametrize("seed", [0, 1])
def test_simulated_run_has_no_leak_and_exact_outputs(chunked, prefix, seed):
    requests, stats = run(chunked, prefix, seed)
    assert stats["preemptions"] > 0, "the pool should be small enough to force preemption"
    for r in requests:
        assert r.is_finished
        assert r.block_ids == []
        if r.request_id in stats["aborted"]:
            assert r.status == RequestStatus.FINISHED_ABORTED
            continue
        assert r.status == RequestStatus.FINISHED_LENGTH
        n = min(r.sampling_params.max_tokens, MAX_MODEL_LEN - r.num_prompt_tokens)
        expected = [fake_token(r.request_id, r.num_prompt_tokens + k) for k in range(n)]
        assert r.output_token_ids == expected
    if prefix:
        assert stats["cache_hits"] > 0
    else:
        assert stats["cache_hits"] == 0
