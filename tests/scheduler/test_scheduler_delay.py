"""``scheduler_delay_factor``: waiting prompts are held while requests run, until the oldest has
waited the factor times the last prompt step, so prompts arriving apart share one prefill step."""

import pytest

from fastdeploy.cache_manager.kv_cache_manager import KVCacheManager
from fastdeploy.config import SchedulerConfig
from fastdeploy.core.request import Request, RequestStatus
from fastdeploy.core.sampling_params import SamplingParams
from fastdeploy.engine.args_utils import EngineArgs
from fastdeploy.scheduler.scheduler import Scheduler


class Clock:
    """A settable clock (seconds) for the scheduler and the requests' arrival times."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(factor: float, clock: Clock) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=64, scheduler_delay_factor=factor
    )
    return Scheduler(config, KVCacheManager(65, 4), max_model_len=64, clock=clock)


def add(sched: Scheduler, clock: Clock, rid: str, n: int = 8, max_tokens: int = 20) -> Request:
    first = 100 * (ord(rid) - ord("a"))  # distinct prompts: no prefix-cache hit
    request = Request(rid, list(range(first, first + n)), SamplingParams(max_tokens=max_tokens))
    request.arrival_time = clock.now
    sched.add_request(request)
    return request


def step(sched: Scheduler, clock: Clock, seconds: float) -> list[tuple[str, int]]:
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
    clock = Clock()
    sched = make(0.0, clock)
    add(sched, clock, "a")
    assert step(sched, clock, 0.004) == [("a", 8)]  # the prompt step: 4 ms
    add(sched, clock, "b")
    assert step(sched, clock, 0.001) == [("a", 1), ("b", 8)]
    add(sched, clock, "c")
    assert step(sched, clock, 0.001) == [("a", 1), ("b", 1), ("c", 8)]


def test_with_a_factor_close_arrivals_share_one_prefill_step():
    clock = Clock()
    sched = make(1.0, clock)
    add(sched, clock, "a")
    # Nothing runs: admitted at once, whatever the factor.
    assert step(sched, clock, 0.002) == [("a", 8)]
    assert step(sched, clock, 0.001) == [("a", 1)]  # measures the prompt step: 2 ms
    add(sched, clock, "b")
    assert step(sched, clock, 0.001) == [("a", 1)]  # b waited 0 ms of the 2 it must
    add(sched, clock, "c")
    assert step(sched, clock, 0.001) == [("a", 1)]  # b waited 1 ms
    # b has waited 2 ms: b and c go together, in one step.
    assert step(sched, clock, 0.003) == [("a", 1), ("b", 8), ("c", 8)]
    assert sched.num_waiting == 0


def test_the_delay_follows_the_last_prompt_step():
    clock = Clock()
    sched = make(2.0, clock)
    add(sched, clock, "a")
    step(sched, clock, 0.001)  # prompt step of 1 ms
    step(sched, clock, 0.001)
    add(sched, clock, "b")
    held = [step(sched, clock, 0.001) for _ in range(2)]
    assert held == [[("a", 1)], [("a", 1)]]  # 2 x 1 ms must pass first
    assert step(sched, clock, 0.005) == [("a", 1), ("b", 8)]  # a prompt step of 5 ms
    step(sched, clock, 0.001)
    add(sched, clock, "c")
    held = [step(sched, clock, 0.001) for _ in range(10)]  # now 2 x 5 ms: calls at 0..9 ms
    assert all(len(s) == 2 for s in held)
    clock.now += 0.0005  # 10.5 ms
    assert step(sched, clock, 0.001)[-1] == ("c", 8)


def test_a_preempted_request_is_not_held():
    """A request preempted by recompute goes back to the front of the queue; its arrival is
    long past, so the delay never holds it."""
    clock = Clock()
    sched = make(1.0, clock)
    add(sched, clock, "a")
    b = add(sched, clock, "b")
    step(sched, clock, 0.002)  # both prompts: a 2 ms prompt step
    clock.now += 1.0
    c = add(sched, clock, "c")
    step(sched, clock, 0.001)
    sched._preempt(b)  # as _allocate_or_preempt would on a full pool
    assert list(sched.waiting) == [b, c]
    # c has waited 1 ms of the 2 ms, but b (arrived 1 s ago) heads the queue: both go.
    assert [rid for rid, _ in step(sched, clock, 0.001)] == ["a", "b", "c"]
    assert b.status == RequestStatus.RUNNING


@pytest.mark.parametrize("bad", [-0.5, float("nan"), float("inf"), True, "1"])
def test_a_bad_factor_is_refused_with_its_value(bad):
    match = r"scheduler_delay_factor=.* is invalid; allowed: a finite"
    with pytest.raises(ValueError, match=match):
        SchedulerConfig(scheduler_delay_factor=bad)


def test_the_cli_flag_reaches_the_scheduler_config():
    parser = EngineArgs.add_cli_args(__import__("argparse").ArgumentParser())
    args = parser.parse_args(["--scheduler-delay-factor", "0.5"])
    assert EngineArgs.from_cli_args(args).scheduler_delay_factor == 0.5
