"""``scheduler_delay_factor``: waiting prompts are held while requests run, until the oldest has
waited more than the factor times the last prompt latency, so prompts arriving apart share one
prefill step. Times are binary fractions of a second, so every sum is exact and the tests probe
the threshold itself (strictly more, as vLLM's rule)."""

import re

import pytest
from support import ManualClock

from fastdeploy.cache_manager.kv_cache_manager import KVCacheManager
from fastdeploy.config import SchedulerConfig
from fastdeploy.core.request import Request, RequestStatus
from fastdeploy.core.sampling_params import SamplingParams
from fastdeploy.engine.args_utils import EngineArgs
from fastdeploy.scheduler.scheduler import Scheduler


def make(factor: float, clock: ManualClock) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=64, scheduler_delay_factor=factor
    )
    return Scheduler(config, KVCacheManager(65, 4), max_model_len=64, clock=clock)


def add(
    sched: Scheduler, clock: ManualClock, rid: str, n: int = 8, max_tokens: int = 40
) -> Request:
    first = 100 * (ord(rid) - ord("a"))  # distinct prompts: no prefix-cache hit
    request = Request(rid, list(range(first, first + n)), SamplingParams(max_tokens=max_tokens))
    request.arrival_time = clock.now
    sched.add_request(request)
    return request


def step(sched: Scheduler, clock: ManualClock, seconds: float) -> list[tuple[str, int]]:
    """Schedule, then let ``seconds`` pass (the step's duration) and apply its tokens."""
    out = sched.schedule()
    clock.now += seconds
    sampled = {s.request.request_id: 7 for s in out.scheduled if s.samples}
    for r in sched.update_from_output(out, sampled):
        if len(r.output_token_ids) >= r.sampling_params.max_tokens:
            sched.finish_request(r, RequestStatus.FINISHED_LENGTH)
    sched.check_integrity()
    return [(s.request.request_id, s.num_new_tokens) for s in out.scheduled]


def test_without_a_factor_every_arrival_gets_its_own_prefill_step():
    clock = ManualClock(64.0)
    sched = make(0.0, clock)
    add(sched, clock, "a")
    assert step(sched, clock, 0.5) == [("a", 8)]
    add(sched, clock, "b")
    assert step(sched, clock, 0.25) == [("a", 1), ("b", 8)]
    add(sched, clock, "c")
    assert step(sched, clock, 0.25) == [("a", 1), ("b", 1), ("c", 8)]


def test_with_a_factor_close_arrivals_share_one_prefill_step():
    clock = ManualClock(64.0)
    sched = make(1.0, clock)
    add(sched, clock, "a")
    # Nothing runs: admitted at once, whatever the factor.
    assert step(sched, clock, 0.5) == [("a", 8)]  # a prompt step of 0.5 s
    add(sched, clock, "b")
    assert step(sched, clock, 0.25) == [("a", 1)]  # b waited 0 s of more than 0.5
    add(sched, clock, "c")
    assert step(sched, clock, 0.25) == [("a", 1)]  # b waited 0.25 s
    assert step(sched, clock, 0.25) == [("a", 1)]  # 0.5 s: not more than 0.5
    # b has waited 0.75 s: b and c go together, in one step.
    assert step(sched, clock, 0.25) == [("a", 1), ("b", 8), ("c", 8)]
    assert sched.num_waiting == 0


def test_the_delay_follows_the_last_prompt_latency():
    clock = ManualClock(64.0)
    sched = make(2.0, clock)
    add(sched, clock, "a")
    step(sched, clock, 0.25)  # a prompt step of 0.25 s: hold for more than 0.5 s
    add(sched, clock, "b")
    held = [step(sched, clock, 0.25) for _ in range(3)]  # b waited 0, 0.25, 0.5 s
    assert held == [[("a", 1)]] * 3
    assert step(sched, clock, 1.0) == [("a", 1), ("b", 8)]  # a prompt step of 1 s
    add(sched, clock, "c")
    held = [step(sched, clock, 0.5) for _ in range(5)]  # now more than 2 s: 0 .. 2 s held
    assert all(len(s) == 2 for s in held)
    assert step(sched, clock, 0.5)[-1] == ("c", 8)  # 2.5 s


def test_an_idle_wait_is_no_prompt_latency():
    """A request that ends in its prompt step leaves nothing running; the time until the next
    call (an idle engine waiting for work) is not a step and must not become the delay."""
    clock = ManualClock(64.0)
    sched = make(1.0, clock)
    add(sched, clock, "a", max_tokens=1)
    assert step(sched, clock, 0.25) == [("a", 8)]  # a ends with its first token
    clock.now += 512.0  # idle
    add(sched, clock, "b")
    assert step(sched, clock, 0.25) == [("b", 8)]  # nothing runs: at once
    assert sched._last_prompt_latency == 0.0  # not the 512.25 s since a's prompt step
    add(sched, clock, "c")
    held = [step(sched, clock, 0.25) for _ in range(2)]  # b's 0.25 s; c waited 0, 0.25 s
    assert held == [[("b", 1)]] * 2
    assert step(sched, clock, 0.25) == [("b", 1), ("c", 8)]  # 0.5 s > 0.25 s


def test_a_preempting_step_still_times_the_prompt_latency():
    """The call after a prompt step measures it even when that call preempts (it admits
    nothing then); a later call must not stretch it to two steps."""
    clock = ManualClock(64.0)
    sched = make(1.0, clock)
    add(sched, clock, "a")
    b = add(sched, clock, "b")
    step(sched, clock, 0.25)  # both prompts: a 0.25 s prompt step
    kv = sched.kv_cache_manager
    allocate = kv.allocate_slots
    kv.allocate_slots = lambda r, n: r is not b and allocate(r, n)  # b, the newest, preempts
    assert step(sched, clock, 0.25) == [("a", 1)]  # b preempted; the 0.25 s interval measured
    assert sched._last_prompt_latency == 0.25


def test_a_preempted_request_is_not_held():
    """A request preempted by recompute goes back to the front of the queue; its arrival is
    long past, so the delay never holds it."""
    clock = ManualClock(64.0)
    sched = make(1.0, clock)
    add(sched, clock, "a")
    b = add(sched, clock, "b")
    step(sched, clock, 0.5)  # both prompts: a 0.5 s prompt step
    clock.now += 64.0
    c = add(sched, clock, "c")
    step(sched, clock, 0.25)
    sched.preempt(b)  # as schedule() would on a full pool
    assert list(sched.waiting) == [b, c]
    # c has waited 0.25 s of more than 0.5, but b (arrived 64 s ago) heads the queue: both go.
    assert [rid for rid, _ in step(sched, clock, 0.25)] == ["a", "b", "c"]
    assert b.status == RequestStatus.RUNNING


def test_a_pd_decode_nodes_request_is_not_held():
    """A request whose prompt's KV is pulled from a prefill node runs no prefill here."""
    clock = ManualClock(64.0)
    sched = make(1.0, clock)
    add(sched, clock, "a")
    step(sched, clock, 0.5)
    b = add(sched, clock, "b")
    b.remote_prefill = {"remote_host": "127.0.0.1"}
    sched.schedule()  # not held: admitted at once to wait for its KV
    assert b.status == RequestStatus.WAITING_FOR_REMOTE_KV


@pytest.mark.parametrize("bad", [-0.5, float("nan"), float("inf"), True, "1"])
def test_a_bad_factor_is_refused_with_its_value(bad):
    match = re.escape(f"scheduler_delay_factor={bad!r} is invalid; allowed: a finite number >= 0")
    with pytest.raises(ValueError, match=match):
        SchedulerConfig(scheduler_delay_factor=bad)


def test_the_cli_flag_reaches_the_scheduler_config():
    parser = EngineArgs.add_cli_args(__import__("argparse").ArgumentParser())
    args = parser.parse_args(["--scheduler-delay-factor", "0.5"])
    assert EngineArgs.from_cli_args(args).scheduler_delay_factor == 0.5
