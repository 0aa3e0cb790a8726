"""Scheduler: token budget, chunked prefill, max_num_seqs, ordering, preemption, abort."""

import time

import pytest

from fastdeploy.cache_manager.kv_cache_manager import KVCacheManager
from fastdeploy.config import SchedulerConfig
from fastdeploy.core.request import Request, RequestStatus, check_prompt
from fastdeploy.core.sampling_params import SamplingParams
from fastdeploy.core.scheduler_output import SchedulerOutput
from fastdeploy.scheduler.scheduler import InsufficientKVCacheError, Scheduler

BS = 4


def make_scheduler(
    num_blocks=65, budget=64, max_num_seqs=8, chunked=True, prefix=True, max_model_len=64
) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, enable_chunked_prefill=chunked
    )
    kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=prefix)
    return Scheduler(config, kv, max_model_len=max_model_len)


def make_request(rid: str, n: int, first: int = 0, max_tokens: int = 4) -> Request:
    return Request(rid, list(range(first, first + n)), SamplingParams(max_tokens=max_tokens))


def token_for(request: Request) -> int:
    return 1000 + request.num_tokens


def step(sched: Scheduler) -> SchedulerOutput:
    """One engine step: schedule, sample fake tokens, update, finish at max_tokens."""
    out = sched.schedule()
    sampled = {s.request.request_id: token_for(s.request) for s in out.scheduled if s.samples}
    for r in sched.update_from_output(out, sampled):
        if len(r.output_token_ids) >= r.sampling_params.max_tokens:
            sched.finish_request(r, RequestStatus.FINISHED_LENGTH)
    sched.check_integrity()
    return out


def shape(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(s.request.request_id, s.num_computed_tokens, s.num_new_tokens) for s in out.scheduled]


def test_chunked_prefill_splits_a_long_prompt():
    sched = make_scheduler(budget=16)
    a = make_request("a", 40)
    sched.add_request(a)
    outs = [step(sched) for _ in range(3)]
    assert [shape(o) for o in outs] == [[("a", 0, 16)], [("a", 16, 16)], [("a", 32, 8)]]
    assert [o.scheduled[0].samples for o in outs[:2]] == [False, False]
    assert a.output_token_ids == [1040]  # sampled only after the last chunk
    assert a.num_computed_tokens == 40
    assert shape(step(sched)) == [("a", 40, 1)]  # then decode
    assert a.output_token_ids == [1040, 1041]


def test_chunk_shares_the_budget_with_decodes():
    sched = make_scheduler(budget=16)
    a = make_request("a", 3, max_tokens=10)
    sched.add_request(a)
    step(sched)
    sched.add_request(make_request("b", 40, first=100))
    assert shape(step(sched)) == [("a", 3, 1), ("b", 0, 15)]
    assert shape(step(sched)) == [("a", 4, 1), ("b", 15, 15)]


def test_decodes_are_scheduled_before_new_prefills():
    sched = make_scheduler(budget=64)
    sched.add_request(make_request("a", 10, max_tokens=5))
    sched.add_request(make_request("b", 6, first=50, max_tokens=5))
    assert shape(step(sched)) == [("a", 0, 10), ("b", 0, 6)]
    sched.add_request(make_request("c", 20, first=100))
    out = step(sched)
    assert shape(out) == [("a", 10, 1), ("b", 6, 1), ("c", 0, 20)]
    assert out.num_batched_tokens == 22
    assert not out.is_decode_only
    assert step(sched).is_decode_only


def test_max_num_seqs_is_honoured():
    sched = make_scheduler(max_num_seqs=2)
    for i in range(5):
        sched.add_request(make_request(f"r{i}", 5, first=10 * i, max_tokens=2))
    out = step(sched)
    assert [s.request.request_id for s in out.scheduled] == ["r0", "r1"]
    assert (sched.num_running, sched.num_waiting) == (2, 3)
    out = step(sched)  # r0, r1 finish on their second token here
    assert [s.request.request_id for s in out.scheduled] == ["r0", "r1"]
    out = step(sched)
    assert [s.request.request_id for s in out.scheduled] == ["r2", "r3"]
    assert out.finished_request_ids == ["r0", "r1"]
    while sched.has_unfinished_requests():
        assert sched.num_running <= 2
        step(sched)


def test_without_chunking_a_prompt_waits_for_room():
    sched = make_scheduler(budget=32, chunked=False, max_model_len=32)
    sched.add_request(make_request("a", 20, max_tokens=3))
    sched.add_request(make_request("b", 20, first=100))
    sched.add_request(make_request("c", 5, first=200))
    # b does not fit the 12 tokens left and, FIFO, c waits behind it.
    assert shape(step(sched)) == [("a", 0, 20)]
    assert shape(step(sched)) == [("a", 20, 1), ("b", 0, 20), ("c", 0, 5)]
    assert shape(step(sched)) == [("a", 21, 1), ("b", 20, 1), ("c", 5, 1)]


def test_without_chunking_the_budget_must_hold_max_model_len():
    with pytest.raises(ValueError, match="max_num_batched_tokens=16"):
        make_scheduler(budget=16, chunked=False, max_model_len=32)
    config = SchedulerConfig(enable_chunked_prefill=False, max_num_batched_tokens=100)
    sched = Scheduler(config, KVCacheManager(9, BS), max_model_len=100)
    assert sched.max_num_batched_tokens == 100
    config = SchedulerConfig(max_num_batched_tokens=2048)
    chunked = Scheduler(config, KVCacheManager(9, BS), max_model_len=100)
    assert chunked.max_num_batched_tokens == 2048


@pytest.mark.parametrize("chunked", [True, False])
def test_an_unresolved_budget_is_refused(chunked):
    """The default budget belongs to EngineArgs.resolve_max_num_batched_tokens, not here."""
    config = SchedulerConfig(enable_chunked_prefill=chunked)  # max_num_batched_tokens=None
    with pytest.raises(
        ValueError, match=r"max_num_batched_tokens=None is invalid.*EngineArgs.create_engine_config"
    ):
        Scheduler(config, KVCacheManager(9, BS), max_model_len=100)


def test_add_request_validation():
    sched = make_scheduler(max_model_len=16)
    sched.add_request(make_request("a", 4))
    with pytest.raises(ValueError, match="already scheduled"):
        sched.add_request(make_request("a", 4))
    with pytest.raises(ValueError, match="'b'.*17 tokens, but max_model_len is 16"):
        sched.add_request(make_request("b", 17))
    with pytest.raises(ValueError, match="'c'.*prompt is empty"):
        sched.add_request(make_request("c", 0))
    assert sched.get_request("a") is not None and sched.get_request("b") is None


def test_the_scheduler_and_the_front_ends_share_one_length_rule():
    """A prompt must leave room for one output token: max_model_len tokens are refused by both
    the scheduler and check_prompt (what LLMEngine.check_request runs), one fewer is accepted."""
    sched = make_scheduler(max_model_len=16)
    check_prompt(list(range(15)), max_model_len=16, vocab_size=1000)
    sched.add_request(make_request("a", 15))
    with pytest.raises(ValueError, match="16 tokens, but max_model_len is 16") as front:
        check_prompt(list(range(16)), max_model_len=16, vocab_size=1000)
    with pytest.raises(ValueError, match="16 tokens, but max_model_len is 16") as back:
        sched.add_request(make_request("b", 16))
    assert str(back.value) == f"request 'b': {front.value}"
    assert sched.get_request("b") is None


def test_prefix_hit_on_admission():
    sched = make_scheduler()
    kv = sched.kv_cache_manager
    a = make_request("a", 14, max_tokens=8)
    sched.add_request(a)
    step(sched)
    # b shares a's first 8 tokens (2 full blocks) and diverges after.
    b = Request("b", list(range(8)) + [77] * 6, SamplingParams(max_tokens=2))
    sched.add_request(b)
    out = step(sched)
    assert shape(out) == [("a", 14, 1), ("b", 8, 6)]
    assert b.num_cached_tokens == 8 and b.reported_cached_tokens == 8
    assert a.first_num_cached_tokens == 0
    assert b.block_ids[:2] == a.block_ids[:2]
    assert [kv.block_pool.ref_count(x) for x in b.block_ids[:2]] == [3, 3]
    assert b.block_ids[2] != a.block_ids[2]


def test_abort_frees_blocks_waiting_and_running():
    sched = make_scheduler(max_num_seqs=1)
    kv = sched.kv_cache_manager
    a, b = make_request("a", 10, max_tokens=50), make_request("b", 6, first=100)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    assert a.status == RequestStatus.RUNNING and b.status == RequestStatus.WAITING
    assert kv.num_free_blocks < kv.num_usable_blocks
    assert sched.abort_request("a")
    assert sched.abort_request("b")
    assert not sched.abort_request("a")
    assert not sched.abort_request("nope")
    assert a.status == RequestStatus.FINISHED_ABORTED and a.finish_reason == "abort"
    assert a.block_ids == [] and not sched.has_unfinished_requests()
    sched.check_integrity()
    assert kv.num_free_blocks == kv.num_usable_blocks
    out = sched.schedule()
    assert out.is_empty and out.finished_request_ids == ["a", "b"]
    assert sched.schedule().finished_request_ids == []


def test_abort_between_schedule_and_update():
    sched = make_scheduler()
    a, b = make_request("a", 5), make_request("b", 5, first=100)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    assert sched.abort_request("a")
    got = sched.update_from_output(out, {"b": 7})
    assert got == [b] and b.output_token_ids == [7]
    assert a.output_token_ids == [] and a.block_ids == []
    sched.check_integrity()


def test_update_from_output_validation():
    sched = make_scheduler(budget=8)
    a, b = make_request("a", 4), make_request("b", 10, first=100)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    assert shape(out) == [("a", 0, 4), ("b", 0, 4)]
    with pytest.raises(ValueError, match="no sampled token"):
        sched.update_from_output(out, {})
    with pytest.raises(ValueError, match="do not sample"):
        sched.update_from_output(out, {"a": 1, "b": 2})
    assert a.num_computed_tokens == 0  # nothing applied by the failed calls
    assert sched.update_from_output(out, {"a": 1}) == [a]
    with pytest.raises(ValueError, match="applied twice"):
        sched.update_from_output(out, {"a": 1})


def test_first_token_time_is_set_once_when_the_first_token_is_appended():
    sched = make_scheduler(budget=16)
    a = make_request("a", 40)
    sched.add_request(a)
    step(sched)
    step(sched)
    assert a.first_token_time is None  # prefill chunks sample nothing
    before = time.monotonic()
    step(sched)
    assert a.output_token_ids == [1040]
    assert before <= a.first_token_time <= time.monotonic()
    first = a.first_token_time
    step(sched)
    assert len(a.output_token_ids) == 2 and a.first_token_time == first


def test_finish_request():
    sched = make_scheduler()
    a = make_request("a", 5)
    sched.add_request(a)
    step(sched)
    with pytest.raises(ValueError, match="finished status"):
        sched.finish_request(a, RequestStatus.RUNNING)
    sched.finish_request(a, RequestStatus.FINISHED_STOPPED)
    assert a.finish_reason == "stop" and a.finish_time is not None
    with pytest.raises(ValueError, match="not waiting or running"):
        sched.finish_request(a, RequestStatus.FINISHED_STOPPED)
    assert sched.schedule().finished_request_ids == ["a"]
    assert sched.kv_cache_manager.num_free_blocks == sched.kv_cache_manager.num_usable_blocks


def test_preemption_by_recompute():
    # 4 usable blocks of 4 tokens: two 7-token prompts fill them once each has 8 tokens.
    sched = make_scheduler(num_blocks=5, max_model_len=16)
    kv = sched.kv_cache_manager
    a = make_request("a", 7, max_tokens=4)
    b = make_request("b", 7, first=100, max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    assert shape(step(sched)) == [("a", 0, 7), ("b", 0, 7)]
    assert shape(step(sched)) == [("a", 7, 1), ("b", 7, 1)]
    assert kv.num_free_blocks == 0 and a.num_tokens == 9
    # a needs a third block: b, the most recently admitted, is preempted.
    out = step(sched)
    assert out.preempted == [b]
    assert shape(out) == [("a", 8, 1)]
    assert b.status == RequestStatus.WAITING and b.num_preemptions == 1
    assert b.num_computed_tokens == 0 and b.block_ids == []
    assert list(sched.waiting) == [b]
    assert b.output_token_ids == [1007, 1008]  # generated tokens are kept
    out = step(sched)  # a finishes (4 tokens); b cannot come back yet
    assert shape(out) == [("a", 9, 1)] and not out.preempted
    assert a.is_finished
    # b resumes: re-prefills prompt + its 2 tokens, its first block still in the prefix cache.
    out = step(sched)
    assert shape(out) == [("b", 4, 5)]
    assert b.num_cached_tokens == 4
    # Outputs report the first admission's hits (none): the re-admission found b's own block.
    assert b.first_num_cached_tokens == 0 and b.reported_cached_tokens == 0
    assert out.finished_request_ids == ["a"]
    assert b.output_token_ids == [1007, 1008, 1009]
    assert b.is_finished
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_preemption_requeues_victims_at_the_front_in_order():
    sched = make_scheduler(num_blocks=6, prefix=False, max_model_len=32)  # 5 usable blocks
    r0, r1 = make_request("r0", 7, max_tokens=8), make_request("r1", 7, first=100, max_tokens=8)
    r2 = make_request("r2", 3, first=200, max_tokens=8)
    late = make_request("late", 3, first=900)
    for r in (r0, r1, r2):
        sched.add_request(r)
    step(sched)
    sched.add_request(late)
    step(sched)  # 2 + 2 + 1 blocks used, 'late' waits
    assert sched.num_waiting == 1 and sched.kv_cache_manager.num_free_blocks == 0
    # r0 needs a third block: r2 (newest) is preempted; r1 then needs one: it preempts itself.
    out = step(sched)
    assert out.preempted == [r2, r1]
    assert shape(out) == [("r0", 8, 1)]
    assert [r.request_id for r in sched.waiting] == ["r1", "r2", "late"]
    assert (r1.num_preemptions, r2.num_preemptions, r0.num_preemptions) == (1, 1, 0)
    while sched.has_unfinished_requests():
        step(sched)
    for r in (r0, r1, r2):
        n = r.num_prompt_tokens
        assert r.output_token_ids == [1000 + n + i for i in range(8)]


def test_every_preemption_is_counted():
    """``num_preemptions`` (read by ``fastdeploy:num_preemptions_total``) counts each preempted
    request once per preemption, victims preempted in the same step included."""
    sched = make_scheduler(num_blocks=6, prefix=False, max_model_len=32)  # 5 usable blocks
    requests = [make_request(f"r{i}", 7, first=100 * i, max_tokens=12) for i in range(3)]
    for r in requests:
        sched.add_request(r)
    assert sched.num_preemptions == 0
    reported = 0
    while sched.has_unfinished_requests():
        reported += len(step(sched).preempted)
    assert sched.num_preemptions == reported == sum(r.num_preemptions for r in requests) >= 2


def test_a_request_larger_than_the_pool_is_an_error():
    sched = make_scheduler(num_blocks=3, max_model_len=32)  # 2 usable blocks = 8 tokens
    a = make_request("a", 8, max_tokens=4)
    sched.add_request(a)
    step(sched)
    with pytest.raises(InsufficientKVCacheError, match="needs 3 KV blocks") as err:
        sched.schedule()
    assert err.value.request_id == "a"
    sched.check_integrity()  # still consistent: a keeps running with its blocks
    assert sched.abort_request("a")
    kv = sched.kv_cache_manager
    assert kv.num_free_blocks == kv.num_usable_blocks
