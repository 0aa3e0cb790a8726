"""No interleaving of PD events leaks a KV block (hypothesis): on a decode node, remote requests
are admitted, pulled, failed (fail or recompute), aborted mid-pull and released, next to local
requests that run and finish; on a prefill node, finished prefill legs hold their blocks until
DONE/ABORT/expiry. The integrity check (pending sends counted as holders) holds after every
event, and at the end every block is free or cached."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from fastdeploy.cache_manager.kv_cache_manager import KVCacheManager
from fastdeploy.config import SchedulerConfig
from fastdeploy.core.request import Request, RequestStatus
from fastdeploy.core.sampling_params import SamplingParams
from fastdeploy.scheduler.scheduler import Scheduler
from fastdeploy.splitwise.protocol import RemotePrefill

BLOCK = 4


def remote_for(n: int) -> RemotePrefill:
    blocks = list(range(1, -(-n // BLOCK) + 1))
    return RemotePrefill("p", "r", "127.0.0.1", 1, blocks, n, 7, 30.0, {}, {})


class Node:
    """A scheduler with the engine's PD bookkeeping, driven by hand (no model)."""

    def __init__(self, num_blocks: int) -> None:
        self.kv = KVCacheManager(num_blocks, BLOCK, enable_prefix_caching=True)
        config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16)
        self.sched = Scheduler(config, self.kv, max_model_len=(num_blocks - 1) * BLOCK)
        self.pending: dict[str, list[int]] = {}  # prefill node: held for decode nodes
        self.pulling: set[str] = set()  # pulls in flight (incl. aborted ones)
        self.n = 0

    def check(self) -> None:
        self.sched.check_integrity(list(self.pending.values()))

    def add(self, length: int, remote: bool, prefill_leg: bool) -> None:
        self.n += 1
        prompt = [(self.n * 31 + i) % 11 + 1 for i in range(length)]  # repeats: prefix hits
        max_tokens = 1 if prefill_leg else 2 + length % 13
        r = Request(f"r{self.n}", prompt, SamplingParams(max_tokens=max_tokens))
        if remote:
            r.remote_prefill = remote_for(length)
        r.remote_decode = prefill_leg and not remote
        self.sched.add_request(r)

    def step(self) -> None:
        out = self.sched.schedule()
        for r in self.sched.take_new_remote_loads():
            self.pulling.add(r.request_id)
        tokens = {s.request.request_id: 5 for s in out.scheduled if s.samples}
        for r in self.sched.update_from_output(out, tokens):
            if len(r.output_token_ids) >= r.sampling_params.max_tokens:
                if r.remote_decode:  # hold the prompt's blocks, as the engine does
                    blocks = r.block_ids[: self.kv.num_blocks_for(r.num_prompt_tokens)]
                    self.kv.hold_blocks(blocks)
                    self.pending[r.request_id] = list(blocks)
                self.sched.finish_request(r, RequestStatus.FINISHED_LENGTH)

    def pull_ends(self, pick: int, outcome: int) -> None:
        if not self.pulling:
            return
        rid = sorted(self.pulling)[pick % len(self.pulling)]
        self.pulling.discard(rid)
        if self.sched.release_cancelled(rid):
            return
        if outcome == 0:
            self.sched.remote_kv_loaded(rid, 5)
        elif outcome == 1:
            self.sched.remote_kv_loaded(rid, None)  # min_tokens masked the carried token
        elif outcome == 2:
            self.sched.remote_kv_failed(rid, recompute=True)
        else:
            r = self.sched.remote_kv_failed(rid, recompute=False)
            self.sched.finish_request(r, RequestStatus.FINISHED_ABORTED)

    def abort(self, pick: int) -> None:
        ids = sorted(r.request_id for r in self.sched.running + list(self.sched.waiting))
        ids += sorted(self.sched.remote_kv.waiting)
        if ids:
            self.sched.abort_request(ids[pick % len(ids)])

    def release_pending(self, pick: int) -> None:
        if self.pending:
            rid = sorted(self.pending)[pick % len(self.pending)]
            self.kv.release_blocks(self.pending.pop(rid))


OPS = st.lists(
    st.tuples(st.integers(0, 6), st.integers(0, 60), st.integers(0, 3)), min_size=1, max_size=80
)


@settings(max_examples=300, deadline=None)
@given(ops=OPS, num_blocks=st.integers(8, 24))
def test_no_interleaving_leaks_a_block(ops, num_blocks):
    node = Node(num_blocks)
    for op, a, b in ops:
        if op == 0:
            length = 1 + a % (node.sched.max_model_len - 16)
            node.add(length, remote=b == 0, prefill_leg=b == 1)
        elif op in (1, 2):
            node.step()
        elif op == 3:
            node.pull_ends(a, b)
        elif op == 4:
            node.abort(a)
        elif op == 5:
            node.release_pending(a)
        else:
            node.pull_ends(a, 0)
            node.step()
        node.check()
    # Drain: end the pulls, abort the rest, release what the prefill side holds.
    while node.pulling:
        node.pull_ends(0, 0)
    for rid in [r.request_id for r in node.sched.running + list(node.sched.waiting)]:
        node.sched.abort_request(rid)
    for rid in list(node.sched.remote_kv.waiting):
        node.sched.abort_request(rid)
        node.sched.release_cancelled(rid)
    while node.pending:
        node.release_pending(0)
    node.check()
    assert node.kv.num_free_blocks == node.kv.num_usable_blocks
    assert node.sched.num_cancelled_loads == 0


def test_lone_running_request_waits_for_blocks_held_by_pulls():
    """Blocks held by decode-leg requests waiting for their KV are not the running request's to
    take: when the one running request cannot grow, it is preempted (and resumes later) rather
    than failing the engine with InsufficientKVCacheError."""
    node = Node(8)  # 7 usable blocks of 4 tokens
    node.add(8, remote=False, prefill_leg=False)  # r1: 2 blocks, grows while decoding
    local = node.sched.get_request("r1")
    local.sampling_params = SamplingParams(max_tokens=20)
    node.step()
    node.add(16, remote=True, prefill_leg=False)  # r2: 4 blocks held while pulling
    preempted = []
    for _ in range(8):
        out = node.sched.schedule()
        preempted += [r.request_id for r in out.preempted]
        tokens = {s.request.request_id: 5 for s in out.scheduled if s.samples}
        node.sched.update_from_output(out, tokens)
        node.check()
        if preempted:
            break
    assert preempted == ["r1"] and local.status == RequestStatus.WAITING
    assert "r2" in node.sched.remote_kv.waiting
    node.sched.remote_kv_loaded("r2", 5)  # the pull ends; r2 runs, r1 waits for room
    node.step()
    node.check()
    assert node.sched.get_request("r2").status == RequestStatus.RUNNING
