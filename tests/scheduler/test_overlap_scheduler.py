"""The scheduler under the overlap schedule: a step is applied as it is launched (``advance``) and
its tokens arrive one step later (``resolve``). Placeholders are scheduled as one-token decodes,
a request that its token in flight ends by length is not scheduled, a preempted request keeps
its token in flight and an aborted one drops it; a pipelined run gives the tokens of a serial
one, through preemption, with the pool intact."""

from __future__ import annotations

from test_scheduler import make_request, make_scheduler, shape

from fastdeploy.core.request import RequestStatus
from fastdeploy.core.scheduler_output import SchedulerOutput
from fastdeploy.scheduler.scheduler import Scheduler


def fake_tokens(out: SchedulerOutput) -> dict[str, int]:
    """The token a step samples, from what the device knows: its position (the same number as
    ``token_for`` in a serial run, placeholders counted)."""
    return {
        s.request.request_id: 1000 + s.num_computed_tokens + s.num_new_tokens
        for s in out.scheduled
        if s.samples
    }


def finish_by_length(sched: Scheduler, got) -> None:
    for r in got:
        if r.reaches_length_limit(sched.max_model_len):
            sched.finish_request(r, RequestStatus.FINISHED_LENGTH)


def run_overlapped(sched: Scheduler, max_steps: int = 200) -> list[SchedulerOutput]:
    """The engine's pipelined loop: schedule and advance step N, then resolve step N-1."""
    in_flight = None
    outs = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests() and in_flight is None:
            return outs
        out = sched.schedule()
        launched = None
        if not out.is_empty:
            tokens = fake_tokens(out)  # before advance: ``samples`` reads the live counters
            launched = (sched.advance(out), tokens)
            outs.append(out)
        if in_flight is not None:
            finish_by_length(sched, sched.resolve(*in_flight))
        in_flight = launched
        sched.check_integrity()
    raise AssertionError("did not finish")


def run_serial(sched: Scheduler, max_steps: int = 200) -> list[SchedulerOutput]:
    outs = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return outs
        out = sched.schedule()
        finish_by_length(sched, sched.update_from_output(out, fake_tokens(out)))
        outs.append(out)
        sched.check_integrity()
    raise AssertionError("did not finish")


def test_a_token_in_flight_is_scheduled_as_a_one_token_decode():
    sched = make_scheduler()
    a = make_request("a", 5, max_tokens=8)
    sched.add_request(a)
    first = sched.schedule()
    assert sched.advance(first) == [a] and a.num_output_placeholders == 1
    second = sched.schedule()  # before the first step's token is known
    assert shape(second) == [("a", 5, 1)] and second.scheduled[0].samples
    assert sched.advance(second) == [a] and a.num_output_placeholders == 2
    assert sched.resolve([a], {"a": 7}) == [a]
    assert a.output_token_ids == [7] and a.num_output_placeholders == 1
    assert a.num_computed_tokens == 6 and a.num_tokens_with_placeholders == 7
    assert shape(sched.schedule()) == [("a", 6, 1)]


def test_a_request_its_token_in_flight_ends_by_length_is_not_scheduled_again():
    sched = make_scheduler()
    a, b = make_request("a", 5, max_tokens=1), make_request("b", 5, first=50, max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    samplers = sched.advance(sched.schedule())
    out = sched.schedule()
    assert shape(out) == [("b", 5, 1)]  # a's token in flight is its last (max_tokens=1)
    got = sched.resolve(samplers, {"a": 1, "b": 2})
    assert got == [a, b]
    finish_by_length(sched, got)
    assert a.is_finished and a.output_token_ids == [1] and not b.is_finished
    sched.check_integrity()


def test_an_aborted_request_drops_its_token_and_a_preempted_one_keeps_it():
    sched = make_scheduler()
    a, b = make_request("a", 5, max_tokens=8), make_request("b", 5, first=50, max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    samplers = sched.advance(sched.schedule())
    sched.abort_request("a")
    sched.preempt(b)  # as a later schedule() would, with b's token still in flight
    assert sched.schedule().is_empty  # b waits: its token is not known yet
    assert sched.resolve(samplers, {"a": 1, "b": 2}) == [b]
    assert a.output_token_ids == [] and b.output_token_ids == [2]
    assert b.status == RequestStatus.WAITING and b.num_output_placeholders == 0
    out = sched.schedule()  # b re-prefills its prompt and the token it kept (a prefix hit first)
    assert shape(out) == [("b", 4, 2)] and out.scheduled[0].samples
    sched.check_integrity()


def test_a_pipelined_run_gives_the_tokens_of_a_serial_run_through_preemption():
    def requests():
        return [
            make_request(f"r{i}", n, first=100 * i, max_tokens=m)
            for i, (n, m) in enumerate([(7, 9), (5, 6), (9, 4), (3, 10), (6, 7)])
        ]

    results = []
    for run in (run_serial, run_overlapped):
        sched = make_scheduler(num_blocks=9, budget=8, max_model_len=32)  # 8 usable blocks
        reqs = requests()
        for r in reqs:
            sched.add_request(r)
        outs = run(sched)
        kv = sched.kv_cache_manager
        assert kv.num_free_blocks == kv.num_usable_blocks
        assert all(r.is_finished and r.num_output_placeholders == 0 for r in reqs)
        preempted = sum(len(o.preempted) for o in outs)
        results.append(([r.output_token_ids for r in reqs], preempted))
    (serial, serial_preempted), (overlapped, overlapped_preempted) = results
    assert overlapped == serial
    assert [len(t) for t in serial] == [9, 6, 4, 10, 7]
    assert serial_preempted > 0 and overlapped_preempted > 0
