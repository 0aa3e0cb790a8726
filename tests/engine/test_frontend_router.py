"""The engine process's side of several API server processes (``FrontendRouter``): each front
end gets its own requests' outputs, a front end that leaves has its requests aborted, the loop
stops after the last one, a duplicate request id is refused, a front end that stops reading is
cut off without holding up the others, and one without outputs still gets the counters."""

from __future__ import annotations

import queue
import threading
import time

import pytest

from fastdeploy.core.messages import (
    AbortRequest,
    AddRequest,
    EngineStats,
    RequestFailed,
    StepOutputs,
    StopLoop,
)
from fastdeploy.core.outputs import EngineOutput
from fastdeploy.core.sampling_params import SamplingParams
from fastdeploy.engine import frontend_router
from fastdeploy.engine.engine_loop import Wake
from fastdeploy.engine.frontend_router import FrontendRouter

PARAMS = SamplingParams(max_tokens=4)
BUSY = {"num_running": 3, "num_waiting": 0}
IDLE = {"num_running": 0, "num_waiting": 0}


class Sent:
    """One front end's pipe: what it was sent; ``closed`` makes a send put StopLoop into the
    inbox, as ``PipeEmitter`` does on a closed pipe; ``hold`` (an Event) blocks each send until it
    is set, as a full pipe does."""

    def __init__(self, inbox) -> None:
        self.inbox = inbox
        self.messages: list = []
        self.closed = False
        self.hold: threading.Event | None = None

    def __call__(self, message) -> None:
        if self.hold is not None:
            self.hold.wait(30)
        if self.closed:
            self.inbox.put(StopLoop())
            return
        self.messages.append(message)


def make(n: int = 3):
    commands: queue.SimpleQueue = queue.SimpleQueue()
    pipes: list[Sent] = []

    def make_emitter(inbox):
        pipes.append(Sent(inbox))
        return pipes[-1]

    return FrontendRouter(commands, make_emitter, n), commands, pipes


def settle(router: FrontendRouter) -> None:
    """Wait until every queued message was sent (the router sends from threads)."""
    deadline = time.monotonic() + 10
    while router.pending():
        assert time.monotonic() < deadline, "messages not sent within 10 s"
        time.sleep(0.002)


def drained(commands: queue.SimpleQueue) -> list:
    return [commands.get_nowait() for _ in range(commands.qsize())]


def out(rid: str, finished: bool = False) -> EngineOutput:
    return EngineOutput(rid, [7], None, finished, "length" if finished else None)


def test_each_front_end_gets_its_own_outputs_and_the_primary_every_step():
    router, commands, pipes = make(3)
    router.inboxes[0].put(AddRequest("a", [1], PARAMS))
    router.inboxes[1].put(AddRequest("b", [1], PARAMS))
    router.inboxes[1].put(AddRequest("c", [1], PARAMS))
    assert [c.request_id for c in drained(commands)] == ["a", "b", "c"]
    router(StepOutputs([out("a"), out("b"), out("c", finished=True)], BUSY, 5.0))
    router(StepOutputs([out("b")], BUSY, 5.01))
    settle(router)
    assert pipes[0].messages == [StepOutputs([out("a")], BUSY, 5.0), StepOutputs([], BUSY, 5.01)]
    assert pipes[1].messages == [
        StepOutputs([out("b"), out("c", True)], BUSY, 5.0), StepOutputs([out("b")], BUSY, 5.01),
    ]  # fmt: skip
    # Front end 2 has no outputs: the counters of the first step (its first message), not
    # again within STATS_EVERY_S.
    assert pipes[2].messages == [StepOutputs([], BUSY, 5.0)]
    assert router.num_owned == 2  # "c" finished
    router(StepOutputs([out("z")], BUSY, 5.2))  # an unknown id (aborted meanwhile): dropped
    router(EngineStats({"n": 3}))
    settle(router)
    # STATS_EVERY_S later, every front end gets the counters
    assert all(p.messages[-2] == StepOutputs([], BUSY, 5.2) for p in pipes)
    assert all(p.messages[-1] == EngineStats({"n": 3}) for p in pipes)


def test_every_front_end_gets_the_step_that_leaves_the_engine_idle():
    router, commands, pipes = make(3)
    router.inboxes[1].put(AddRequest("b", [1], PARAMS))
    router(StepOutputs([out("b")], BUSY, 1.0))
    router(StepOutputs([out("b", finished=True)], IDLE, 1.001))
    settle(router)
    assert [m.stats for m in pipes[2].messages] == [BUSY, IDLE]
    assert [m.stats for m in pipes[0].messages] == [BUSY, IDLE]


def test_fail_goes_to_the_owner_and_an_abort_forgets_the_request():
    router, commands, pipes = make(2)
    router.inboxes[1].put(AddRequest("a", [1], PARAMS))
    router.inboxes[1].put(AddRequest("b", [1], PARAMS))
    router.inboxes[1].put(AbortRequest("b"))
    router.inboxes[0].put(Wake())
    assert drained(commands) == [
        AddRequest("a", [1], PARAMS), AddRequest("b", [1], PARAMS), AbortRequest("b"), Wake(),
    ]  # fmt: skip
    error = ValueError("bad")
    router(RequestFailed("a", error))
    settle(router)
    assert pipes[1].messages == [RequestFailed("a", error)] and pipes[0].messages == []
    assert router.num_owned == 0


def test_a_duplicate_request_id_is_refused_without_taking_over_the_outputs():
    router, commands, pipes = make(2)
    router.inboxes[0].put(AddRequest("a", [1], PARAMS))
    router.inboxes[1].put(AddRequest("a", [2], PARAMS))
    assert len(drained(commands)) == 1
    router(StepOutputs([out("a")], BUSY, 0.0))
    settle(router)
    failed = pipes[1].messages[0]
    assert (type(failed), failed.request_id) == (RequestFailed, "a")
    assert "already in flight from API server 0" in str(failed.error)
    assert pipes[0].messages[-1].outputs == [out("a")]
    assert [type(m) for m in pipes[1].messages] == [RequestFailed]  # not a's outputs


def test_a_front_end_that_leaves_has_its_requests_aborted_and_the_last_stops_the_loop():
    router, commands, pipes = make(3)
    for i, rid in enumerate(["a", "b", "c"]):
        router.inboxes[i].put(AddRequest(rid, [1], PARAMS))
    router.inboxes[1].put(AddRequest("d", [1], PARAMS))
    drained(commands)
    router.inboxes[1].put(StopLoop())  # its graceful shutdown
    assert drained(commands) == [AbortRequest("b"), AbortRequest("d")]
    router.inboxes[1].put(StopLoop())  # then its pipe closes: nothing more
    router.inboxes[1].put(AddRequest("e", [1], PARAMS))  # nothing of it reaches the loop
    assert drained(commands) == []
    # b's last token, before its abort
    router(StepOutputs([out("a"), out("b"), out("c")], BUSY, 0.0))
    settle(router)
    assert [m.outputs for m in pipes[0].messages] == [[out("a")]] and pipes[1].messages == []
    pipes[2].closed = True  # its pipe closed under a send: it leaves
    router(EngineStats({}))
    settle(router)
    assert drained(commands) == [AbortRequest("c")]
    router.inboxes[0].put(StopLoop())
    assert drained(commands) == [AbortRequest("a"), StopLoop()]
    assert router.num_owned == 0


def test_a_front_end_that_stops_reading_is_cut_off_and_holds_up_no_other(monkeypatch):
    monkeypatch.setattr(frontend_router, "STUCK_S", 0.3)
    router, commands, pipes = make(3)
    for i, rid in enumerate(["a", "b", "c"]):
        router.inboxes[i].put(AddRequest(rid, [1], PARAMS))
    drained(commands)
    pipes[1].hold = threading.Event()  # its pipe is full: each send blocks
    sent_before = time.monotonic()
    step = 0
    while time.monotonic() - sent_before < 1.0:  # the loop steps on, never blocked
        router(StepOutputs([out("a"), out("b"), out("c")], BUSY, float(step)))
        step += 1
        time.sleep(0.01)
    assert drained(commands) == [AbortRequest("b")]  # cut off: its request aborted
    assert len(pipes[0].messages) == step and len(pipes[2].messages) == step
    assert pipes[1].messages == []
    pipes[1].hold.set()  # it reads again: the send in progress ends, then nothing more
    router(StepOutputs([out("a"), out("b"), out("c")], BUSY, float(step)))
    router.close(5)
    assert len(pipes[1].messages) == 1 and router.num_owned == 2


def test_one_front_end_does_not_take_a_router():
    with pytest.raises(ValueError, match="num_frontends=1 is invalid"):
        FrontendRouter(queue.SimpleQueue(), lambda inbox: None, 1)
