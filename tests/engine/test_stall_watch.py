"""StallWatch: the clock runs only while there is work, starts when work reaches an idle engine,
is not restarted by more work for a busy one, and the threshold is checked when set."""

from __future__ import annotations

import pytest
from support import ManualClock

from fastdeploy.entrypoints.engine_client.stall_watch import StallWatch, check_stall_timeout


def test_stalled_only_past_the_threshold_while_there_is_work():
    clock = ManualClock(100.0)
    watch = StallWatch(20, clock)
    clock.now = 500.0  # idle for 400 s: healthy
    assert watch.stalled_for(0) is None and watch.reason(0) is None
    watch.work_added(0)  # a request for an idle engine: the clock starts now
    clock.now = 519.0
    assert watch.stalled_for(1) is None
    clock.now = 521.5
    assert watch.stalled_for(1) == pytest.approx(21.5)
    reason = watch.reason(1)
    assert "21.5 s" in reason and "1 request(s)" in reason and "--engine-stall-timeout=20" in reason
    watch.progress(engine_busy=True)  # a step ended
    assert watch.stalled_for(1) is None


def test_more_work_for_a_busy_engine_does_not_restart_the_clock():
    clock = ManualClock(0.0)
    watch = StallWatch(10, clock)
    watch.work_added(0)
    watch.progress(engine_busy=True)
    clock.now = 8.0
    watch.work_added(1)  # this process already has one in flight
    watch.work_added(0)  # another process's work keeps the engine busy (its counters say so)
    clock.now = 10.5
    assert watch.stalled_for(2) == pytest.approx(10.5)


def test_the_engines_own_work_counts_without_requests_here():
    """With --api-server-count, another process's requests show in the engine's counters."""
    clock = ManualClock(0.0)
    watch = StallWatch(5, clock)
    watch.progress(engine_busy=True)
    clock.now = 6.0
    assert watch.stalled_for(0) == pytest.approx(6.0)
    watch.progress(engine_busy=False)  # the engine reported it has nothing left
    clock.now = 60.0
    assert watch.stalled_for(0) is None


@pytest.mark.parametrize("off", [None, 0, 0.0])
def test_zero_or_none_turns_the_check_off(off):
    clock = ManualClock(0.0)
    watch = StallWatch(off, clock)
    watch.work_added(0)
    clock.now = 1e6
    assert watch.timeout_s is None and watch.stalled_for(3) is None


@pytest.mark.parametrize("bad", [-1, float("nan"), "10", True])
def test_a_bad_threshold_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match=r"--engine-stall-timeout=.*allowed: seconds > 0, or 0"):
        check_stall_timeout(bad)
