"""The background capture's order, its atomic switch to replay, its failure record and its pacer
(issue #47), without a device: :mod:`fastdeploy.model_executor.graph_optimization.capture_order`."""

from __future__ import annotations

import pytest
from support import ManualClock

from fastdeploy.config.plan import GraphPlan
from fastdeploy.model_executor.graph_optimization.capture_order import (
    CaptureProgress,
    CaptureTask,
    GapPacer,
    background_order,
    blocking_order,
)
from fastdeploy.model_executor.graph_optimization.capture_sizes import (
    default_decode_sizes,
    default_prefill_sizes,
)


def plan(prefill: list[int], decode: list[int]) -> GraphPlan:
    return GraphPlan(bool(decode), bool(prefill), decode, prefill)


def order(tasks: list[CaptureTask]) -> list[tuple[str, int, int]]:
    return [(t.kind, t.size, t.phase) for t in tasks]


def test_the_docstring_example():
    got = background_order(plan([1024, 512, 16], [16, 8, 1]), capture_logits=False)
    assert order(got) == [
        ("decode", 8, 1), ("decode", 1, 1), ("prefill", 512, 1), ("prefill", 16, 1),
        ("decode", 16, 2), ("prefill", 1024, 2),
    ]  # fmt: skip


def test_the_default_ladders_put_what_traffic_needs_first_and_keep_largest_first_per_phase():
    p = plan(default_prefill_sizes(8192, 8192), default_decode_sizes(256))
    tasks = background_order(p, capture_logits=True)
    assert sorted(order(tasks)) == sorted(
        (t.kind, t.size, 1 if t.size <= (512 if t.kind == "prefill" else 8) else 2)
        for t in blocking_order(p, capture_logits=True)
    )  # the same tasks, each in its phase
    phases = [t.phase for t in tasks]
    assert phases == sorted(phases)  # every phase-1 task before every phase-2 task
    first = [t for t in tasks if t.phase == 1]
    assert [t.size for t in first if t.kind == "decode"] == [8, 4, 2, 1]
    assert [t.size for t in first if t.kind == "sampled"] == [8, 4, 2, 1]
    assert max(t.size for t in first if t.kind == "prefill") == 512
    for phase in (1, 2):
        kinds = [t.kind for t in tasks if t.phase == phase]
        assert kinds == sorted(kinds, key=["decode", "prefill", "sampled"].index)
        for kind in ("prefill", "decode", "sampled"):
            sizes = [t.size for t in tasks if t.phase == phase and t.kind == kind]
            assert sizes == sorted(sizes, reverse=True) and sizes  # largest first
    assert len(tasks) == len(p.prefill_capture_sizes) + 2 * len(p.decode_capture_sizes)


def test_the_blocking_order_is_the_capture_before_serving():
    p = plan([64, 16], [4, 2, 1])
    assert order(blocking_order(p, capture_logits=True)) == [
        ("prefill", 64, 1), ("prefill", 16, 1), ("decode", 4, 1), ("decode", 2, 1),
        ("decode", 1, 1), ("sampled", 4, 1), ("sampled", 2, 1), ("sampled", 1, 1),
    ]  # fmt: skip
    # Sampled-row graphs need decode logits and piecewise buckets.
    assert [t.kind for t in blocking_order(plan([], [2, 1]), True)] == ["decode", "decode"]
    assert [t.kind for t in blocking_order(p, False)].count("sampled") == 0


def test_a_bucket_replays_only_after_its_capture_returned_and_a_failed_one_never():
    p = plan([1024, 64], [16, 4])
    progress = CaptureProgress(background_order(p, capture_logits=False))
    seen = []
    while not progress.done:
        task = progress.next_task()
        # Until captured(), the step of this bucket stays eager: no half-built replay.
        mode = "piecewise" if task.kind == "prefill" else "full"
        assert not progress.is_ready(mode, task.size)
        if task == CaptureTask("decode", 4, 1):
            progress.failed(task, "OutOfMemoryError: CUDA out of memory", 0.5)
        else:
            progress.captured(task, 0.25)
        seen.append(dict(progress.ready))
    for before, after in zip(seen, seen[1:]):  # grows one bucket at a time, never shrinks
        assert all(before[k] <= after[k] for k in before)
        assert sum(len(after[k]) - len(before[k]) for k in after) <= 1
    assert progress.is_ready("piecewise", 1024) and progress.is_ready("full", 16)
    assert not progress.is_ready("full", 4) and progress.is_ready("eager", None)
    stats = progress.stats()
    oom = "OutOfMemoryError: CUDA out of memory"
    assert stats == {
        "background": True, "total": 4, "captured": 3, "failed": 1, "done": True,
        "seconds": 1.25, "seconds_by_phase": {"1": 0.75, "2": 0.5},
        "by_kind": {"prefill": [2, 2], "decode": [1, 2]},
        "failures": [{"kind": "decode", "size": 4, "reason": oom}],
    }  # fmt: skip


def test_the_ready_sets_are_replaced_not_mutated():
    progress = CaptureProgress([CaptureTask("decode", 2), CaptureTask("decode", 1)])
    before = progress.ready
    progress.captured(CaptureTask("decode", 2))
    assert before["decode"] == frozenset() and progress.ready["decode"] == {2}
    assert isinstance(progress.ready["decode"], frozenset)


def test_tasks_are_taken_in_order_and_checked():
    progress = CaptureProgress([CaptureTask("decode", 2), CaptureTask("decode", 1)])
    with pytest.raises(RuntimeError, match="out of order"):
        progress.captured(CaptureTask("decode", 1))
    with pytest.raises(ValueError, match="kind='graph' is invalid"):
        CaptureTask("graph", 1)
    with pytest.raises(ValueError, match="size=0 is invalid"):
        CaptureTask("decode", 0)


def test_the_pacer_gives_capture_half_the_time_while_busy_and_all_of_it_while_idle():
    clock = ManualClock(100.0)
    pacer = GapPacer(0.5, clock=clock)
    assert pacer.due(busy=True)  # nothing captured yet
    pacer.record(0.2)  # a 0.2 s capture just ended
    assert not pacer.due(busy=True) and pacer.due(busy=False)
    clock.now = 100.19
    assert not pacer.due(busy=True)
    clock.now = 100.2
    assert pacer.due(busy=True)
    quarter = GapPacer(0.25, clock=clock)
    quarter.record(0.1)  # 0.3 s of steps before the next
    clock.now = 100.49
    assert not quarter.due(busy=True)
    clock.now = 100.5
    assert quarter.due(busy=True)
    always = GapPacer(1.0, clock=clock)
    always.record(5.0)
    assert always.due(busy=True)
    for bad in (0, 1.5, -0.1):
        with pytest.raises(ValueError, match="busy_share"):
            GapPacer(bad)


def test_the_busy_share_comes_from_the_environment_and_is_checked(monkeypatch):
    from fastdeploy import envs

    monkeypatch.setenv("FD_GRAPH_CAPTURE_BUSY_SHARE", "0.25")
    assert envs.FD_GRAPH_CAPTURE_BUSY_SHARE() == 0.25
    for bad in ("0", "1.5", "half", "nan"):
        monkeypatch.setenv("FD_GRAPH_CAPTURE_BUSY_SHARE", bad)
        with pytest.raises(ValueError, match="FD_GRAPH_CAPTURE_BUSY_SHARE=.*> 0 and <= 1"):
            envs.FD_GRAPH_CAPTURE_BUSY_SHARE()
    monkeypatch.delenv("FD_GRAPH_CAPTURE_BUSY_SHARE")
    assert envs.FD_GRAPH_CAPTURE_BUSY_SHARE() == pytest.approx(1 / 3)


@pytest.mark.slow
def test_a_server_with_a_bad_busy_share_exits_2_before_the_engine_process_starts(tmp_path):
    import os
    import subprocess
    import sys
    import time

    env = {**os.environ, "FD_GRAPH_CAPTURE_BUSY_SHARE": "abc"}
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "fastdeploy.entrypoints.openai.api_server", "--device", "cpu",
         "--model", str(tmp_path / "no-such-model")],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert out.returncode == 2
    # Named with what is allowed, and not the missing model: checked before the config is read.
    assert "FD_GRAPH_CAPTURE_BUSY_SHARE='abc' is invalid; allowed: a number > 0" in out.stderr
    assert "engine process" not in out.stderr
    assert time.monotonic() - start < 60
