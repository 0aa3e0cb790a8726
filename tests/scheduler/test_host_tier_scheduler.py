"""The host KV tier's bookkeeping with the scheduler, no model: write-through after a block is
cached (device block held until its store landed, host block unpublished until then), the
two-tier lookup (device chain, then host), request-mode swap-ins that wait in
WAITING_FOR_SWAP_IN, layerwise ones that run at once, aborts during a swap-in, preemption that
re-admits from the host, and the integrity check after every event of random interleavings
(hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastdeploy.cache_manager.host_tier import HostTier
from fastdeploy.cache_manager.kv_cache_manager import KVCacheManager
from fastdeploy.cache_manager.prefix_cache import hash_full_blocks
from fastdeploy.config import SchedulerConfig
from fastdeploy.core.request import Request, RequestStatus
from fastdeploy.core.sampling_params import SamplingParams
from fastdeploy.scheduler.scheduler import Scheduler

BLOCK = 4


class Job:
    """A copy that lands when the test says so."""

    def __init__(self, kind: str, src: list[int], dst: list[int], layers: int) -> None:
        self.kind, self.src, self.dst = kind, src, dst
        self.landed = False
        self.events = [self] * layers  # per-layer "events": the job itself

    def done(self) -> bool:
        return self.landed


class FakeCopier:
    def __init__(self) -> None:
        self.jobs: list[Job] = []

    def store_blocks(self, device_blocks, host_blocks) -> Job:
        self.jobs.append(Job("store", list(device_blocks), list(host_blocks), 1))
        return self.jobs[-1]

    def load_blocks(self, host_blocks, device_blocks, per_layer) -> Job:
        self.jobs.append(Job("load", list(host_blocks), list(device_blocks), 3 if per_layer else 1))
        return self.jobs[-1]

    def land_all(self) -> None:
        for job in self.jobs:
            job.landed = True
        self.jobs = []


class Node:
    """A scheduler with the engine's host-tier bookkeeping, driven by hand."""

    def __init__(self, num_blocks=12, host_blocks=16, mode="request", policy="prompt", seqs=4):
        self.kv = KVCacheManager(num_blocks, BLOCK, enable_prefix_caching=True)
        self.copier = FakeCopier()
        self.tier = HostTier(self.kv, host_blocks, 100, self.copier, mode, policy)
        config = SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=16)
        self.sched = Scheduler(config, self.kv, (num_blocks - 1) * BLOCK, self.tier)
        self.n = 0
        self.layer_events: list | None = None

    def check(self) -> None:
        self.tier.check_integrity()
        self.sched.check_integrity(self.tier.held_block_tables())

    def add(self, prompt: list[int], max_tokens: int = 3) -> Request:
        self.n += 1
        r = Request(f"r{self.n}", list(prompt), SamplingParams(max_tokens=max_tokens))
        self.sched.add_request(r)
        return r

    def step(self):
        """One engine step: poll and store, schedule, issue swap-ins, apply fake tokens."""
        for r in self.tier.begin_step():
            self.sched.swap_in_landed(r)
        out = self.sched.schedule()
        self.layer_events = self.tier.issue_swap_ins()
        tokens = {s.request.request_id: 7 for s in out.scheduled if s.samples}
        for r in self.sched.update_from_output(out, tokens):
            if len(r.output_token_ids) >= r.sampling_params.max_tokens:
                self.sched.finish_request(r, RequestStatus.FINISHED_LENGTH)
        self.check()
        return out

    def drain(self, limit: int = 200) -> None:
        for _ in range(limit):
            if not (self.sched.has_unfinished_requests() or self.tier.has_work):
                return
            self.copier.land_all()
            self.step()
        raise AssertionError("the node did not drain")


def prompt(length: int, seed: int = 0) -> list[int]:
    return [(seed * 131 + i * 7) % 97 + 1 for i in range(length)]


def test_store_holds_the_device_block_and_publishes_only_after_landing():
    node = Node()
    r = node.add(prompt(10), max_tokens=1)  # 2 full blocks
    node.step()  # prefill: 2 blocks enter the device prefix cache
    assert r.is_finished and node.tier.host.num_used == 0  # stored at the next step's start
    node.step()
    (store,) = node.copier.jobs
    assert store.kind == "store" and len(store.src) == 2
    for block in store.src:  # held by the store: neither free nor evictable
        assert node.kv.block_pool.ref_count(block) == 2
    assert node.kv.num_free_blocks == node.kv.num_usable_blocks - 2
    again = Request("probe", prompt(10), SamplingParams())
    assert node.tier.lookup(again) == []  # storing blocks never hit
    store.landed = True
    node.step()
    assert node.tier.host.num_published == 2
    assert node.kv.num_free_blocks == node.kv.num_usable_blocks
    assert node.tier.lookup(again) == [0, 1]
    assert node.tier.get_stats()["host_store_bytes"] == 200


def test_request_mode_hit_waits_for_its_swap_in_then_runs():
    node = Node(num_blocks=8)
    node.add(prompt(13), max_tokens=1)
    node.drain()
    node.add(prompt(27, seed=1), max_tokens=1)  # evicts the first prompt's device blocks
    node.drain()
    first = hash_full_blocks(prompt(13), BLOCK)
    assert [node.kv.prefix_cache.lookup(h) for h in first] == [None] * 3
    assert all(node.tier.host.lookup(h) is not None for h in first)
    r = node.add(prompt(13) + [5], max_tokens=2)
    out = node.step()
    assert not out.scheduled and r.status == RequestStatus.WAITING_FOR_SWAP_IN
    assert r.num_computed_tokens == r.num_cached_tokens == 12  # 3 host blocks
    assert node.sched.num_waiting_for_swap_in == 1
    (load,) = [j for j in node.copier.jobs if j.kind == "load"]
    assert load.dst == r.block_ids[:3] and len(load.events) == 1
    assert node.layer_events is None
    for _ in range(3):  # not landed: it keeps waiting, holding its blocks
        assert not node.step().scheduled
    load.landed = True
    node.step()  # landed: running from this step
    assert r.status == RequestStatus.RUNNING and r.num_computed_tokens == 14
    assert node.tier.get_stats()["host_cache_hit_tokens"] == 12
    node.drain()


def test_layerwise_hit_runs_in_the_same_step_with_per_layer_events():
    node = Node(num_blocks=8, mode="layerwise")
    node.add(prompt(13), max_tokens=1)
    node.drain()
    node.add(prompt(27, seed=1), max_tokens=1)
    node.drain()
    r = node.add(prompt(13) + [5], max_tokens=2)
    out = node.step()
    assert [s.request for s in out.scheduled] == [r]
    assert out.scheduled[0].num_computed_tokens == 12 and out.scheduled[0].num_new_tokens == 2
    assert len(node.layer_events) == 3  # one per layer
    assert node.tier.host.pin_counts() == {0: 1, 1: 1, 2: 1}  # pinned until the job is seen done
    node.drain()
    assert node.tier.host.pin_counts() == {}


def test_device_chain_then_host_chain():
    node = Node(num_blocks=10, host_blocks=8)
    node.add(prompt(17), max_tokens=1)
    node.drain()
    assert node.tier.host.num_published == 4
    # Evict the device copies of blocks 2 and 3 only: they are the tail, released first.
    node.kv.block_pool.free(node.kv.prefix_cache.evict(2))
    r = Request("x", prompt(17) + [1], SamplingParams())
    assert node.kv.get_computed_blocks(r) == 8  # device: blocks 0, 1
    assert len(node.tier.lookup(r)) == 2  # host continues: blocks 2, 3
    node.kv.free(r)


def test_all_or_nothing_allocation_leaves_host_unpinned():
    node = Node(num_blocks=8, seqs=1)
    node.add(prompt(13), max_tokens=1)
    node.drain()
    node.add(prompt(27, seed=1), max_tokens=1)
    node.drain()
    big = node.add(prompt(26, seed=2), max_tokens=3)  # runs, holds 7 blocks
    node.step()
    r = node.add(prompt(13) + [5], max_tokens=1)
    node.step()
    assert r.status == RequestStatus.WAITING and not r.block_ids and not r.num_computed_tokens
    assert node.tier.host.pin_counts() == {} and big.status == RequestStatus.RUNNING
    node.drain()


def test_abort_during_swap_in_frees_only_after_the_copy_landed():
    node = Node(num_blocks=8)
    node.add(prompt(13), max_tokens=1)
    node.drain()
    node.add(prompt(27, seed=1), max_tokens=1)
    node.drain()
    r = node.add(prompt(13) + [5], max_tokens=2)
    node.step()
    blocks = list(r.block_ids)
    assert node.sched.abort_request(r.request_id)
    assert r.status == RequestStatus.FINISHED_ABORTED
    assert node.sched.num_cancelled_swap_ins == 1
    node.step()
    for b in blocks:  # parked: still referenced while the copy may write them
        assert node.kv.block_pool.ref_count(b) >= 1
    assert node.tier.has_work
    node.drain()
    assert node.sched.num_cancelled_swap_ins == 0 and not r.block_ids
    assert node.kv.num_free_blocks == node.kv.num_usable_blocks
    assert node.tier.host.pin_counts() == {}


def test_preempted_request_is_readmitted_from_the_host():
    node = Node(num_blocks=9, host_blocks=16, seqs=2)
    a = node.add(prompt(14, seed=3), max_tokens=12)
    b = node.add(prompt(14, seed=4), max_tokens=12)
    for _ in range(40):
        node.copier.land_all()
        node.step()
        if a.num_preemptions or b.num_preemptions:
            break
    victim = a if a.num_preemptions else b
    assert victim.num_preemptions
    hits_before = node.tier.stats.hit_tokens
    node.drain()
    assert node.tier.stats.hit_tokens > hits_before  # its prompt blocks came back from the host
    assert len(victim.output_token_ids) == 12


@pytest.mark.parametrize("policy, stored", [("prompt", 2), ("all", 4)])
def test_store_policy(policy, stored):
    node = Node(host_blocks=8, policy=policy)
    node.add(prompt(8), max_tokens=9)  # 2 prompt blocks, then 2 full blocks of decode tokens
    node.drain()
    assert node.tier.host.num_published == stored


def test_bad_arguments_are_named():
    kv = KVCacheManager(8, BLOCK, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="needs prefix caching"):
        HostTier(kv, 4, 1, FakeCopier())
    kv = KVCacheManager(8, BLOCK)
    with pytest.raises(ValueError, match="swap_in_mode='eager' is invalid; allowed: request"):
        HostTier(kv, 4, 1, FakeCopier(), "eager")
    with pytest.raises(ValueError, match="host_store_policy='none' is invalid"):
        HostTier(kv, 4, 1, FakeCopier(), "request", "none")


EVENTS = st.lists(
    st.tuples(st.sampled_from(["add", "step", "step", "land", "land_one", "abort"]),
              st.integers(0, 50)),
    max_size=60,
)  # fmt: skip


@settings(max_examples=150, deadline=None)
@given(EVENTS, st.sampled_from(["request", "layerwise"]), st.sampled_from(["prompt", "all"]))
def test_integrity_after_every_event(events, mode, policy):
    node = Node(num_blocks=8, host_blocks=12, mode=mode, policy=policy)
    live: list[Request] = []
    for op, k in events:
        if op == "add":
            # Three prefixes shared by many prompts (device hits, host hits, misses); prompt and
            # output fit the 7-block pool.
            live.append(node.add(prompt(4 + k % 18, seed=k % 3) + [k], max_tokens=1 + k % 5))
        elif op == "step":
            node.step()
        elif op == "land":
            node.copier.land_all()
        elif op == "land_one" and node.copier.jobs:
            node.copier.jobs.pop(k % len(node.copier.jobs)).landed = True
        elif op == "abort" and live:
            node.sched.abort_request(live[k % len(live)].request_id)
        node.check()
    node.drain()
    assert node.kv.num_free_blocks == node.kv.num_usable_blocks
    assert node.tier.host.storing_blocks() == set() and node.tier.host.pin_counts() == {}
    assert not node.tier.has_work
