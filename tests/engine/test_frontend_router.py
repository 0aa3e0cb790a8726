"""The engine process's side of several API server processes (``FrontendRouter``): each front
end gets its own requests' outputs, a front end that leaves has its requests aborted, the loop
stops after the last one, and a duplicate request id is refused."""

from __future__ import annotations

import queue

import pytest

from fastdeploy.core.outputs import EngineOutput
from fastdeploy.core.sampling_params import SamplingParams
from fastdeploy.engine.engine_loop import AbortRequest, AddRequest, StopLoop, Wake
from fastdeploy.engine.frontend_router import FrontendRouter

PARAMS = SamplingParams(max_tokens=4)


class Sent:
    """One front end's pipe: what it was sent; ``closed`` makes a send put StopLoop into the
    inbox, as ``_Emitter`` does on a closed pipe."""

    def __init__(self, inbox) -> None:
        self.inbox = inbox
        self.messages: list[tuple] = []
        self.closed = False

    def __call__(self, kind, *args) -> None:
        if self.closed:
            self.inbox.put(StopLoop())
            return
        self.messages.append((kind, *args))

    def kinds(self) -> list[str]:
        return [m[0] for m in self.messages]


def make(n: int = 3):
    commands: queue.SimpleQueue = queue.SimpleQueue()
    pipes: list[Sent] = []

    def make_emitter(inbox):
        pipes.append(Sent(inbox))
        return pipes[-1]

    return FrontendRouter(commands, make_emitter, n), commands, pipes


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
    router("step", [out("a"), out("b"), out("c", finished=True)], {"n": 1}, 5.0)
    assert pipes[0].messages == [("step", [out("a")], {"n": 1}, 5.0)]
    assert pipes[1].messages == [("step", [out("b"), out("c", True)], {"n": 1}, 5.0)]
    assert pipes[2].messages == []  # nothing of its own, not the primary
    assert router.num_owned == 2  # "c" finished
    router("step", [out("z")], {"n": 2}, 6.0)  # an unknown id (aborted meanwhile): dropped
    assert pipes[0].messages[-1] == ("step", [], {"n": 2}, 6.0)
    assert len(pipes[1].messages) == 1
    router("stats", {"n": 3})
    assert all(p.messages[-1] == ("stats", {"n": 3}) for p in pipes)


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
    router("fail", "a", error)
    assert pipes[1].messages == [("fail", "a", error)] and pipes[0].messages == []
    assert router.num_owned == 0


def test_a_duplicate_request_id_is_refused_without_taking_over_the_outputs():
    router, commands, pipes = make(2)
    router.inboxes[0].put(AddRequest("a", [1], PARAMS))
    router.inboxes[1].put(AddRequest("a", [2], PARAMS))
    assert len(drained(commands)) == 1
    kind, rid, error = pipes[1].messages[0]
    assert (kind, rid) == ("fail", "a") and "already in flight from API server 0" in str(error)
    router("step", [out("a")], {}, 0.0)
    assert pipes[0].messages[-1][1] == [out("a")] and len(pipes[1].messages) == 1


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
    router("step", [out("a"), out("b")], {}, 0.0)  # b's last token, before its abort ran
    assert [m[1] for m in pipes[0].messages] == [[out("a")]] and pipes[1].messages == []
    pipes[2].closed = True  # its pipe closed under a send: it leaves, inside the send
    router("stats", {})
    assert drained(commands) == [AbortRequest("c")]
    router.inboxes[0].put(StopLoop())
    assert drained(commands) == [AbortRequest("a"), StopLoop()]
    assert router.num_owned == 0


def test_one_front_end_does_not_take_a_router():
    with pytest.raises(ValueError, match="num_frontends=1 is invalid"):
        FrontendRouter(queue.SimpleQueue(), lambda inbox: None, 1)
