"""One engine process serving several API server processes (``--api-server-count N``, vLLM's
flag): the engine process's side.

Each API server process (a front end) has its own pair of pipes to the engine process. The
commands of all of them go into the one queue that
:class:`~fastdeploy.engine.engine_loop.EngineLoop` drains, and :class:`FrontendRouter` remembers
which front end added each request, so that the loop's messages go back to where they belong:

* :class:`~fastdeploy.core.messages.StepOutputs`: each front end gets its own requests'
  outputs, with the step's counters and time; front end 0 (the primary, which exports the
  engine's counters) gets every step's message, the others only the steps that have outputs of
  theirs;
* :class:`~fastdeploy.core.messages.RequestFailed`: to the request's front end;
* every other message (``EngineStats``, ``EngineDead``, ``EngineReady``, ``EngineStartFailed``):
  to every front end.

A front end leaves by ``StopLoop`` (its graceful shutdown) or by its pipe closing (it died); the
router then aborts the requests it still owned, so their KV blocks are freed, and once every front
end has left the loop gets ``StopLoop``. A request id that another front end already has in
flight is refused (``RequestFailed`` with a ``ValueError``) instead of taking over its outputs.

Each front end's messages are sent by a thread of its own (:class:`_Sender`), so a front end
that stops reading (a hung process: its pipe fills up) never blocks the loop or the others; one
whose oldest unsent message has waited :data:`STUCK_S` is cut off: it leaves as above, and its
pipe is closed once its last send returns (it then sees the engine as gone). A front end without
outputs in a step still gets the step's counters every :data:`STATS_EVERY_S` and whenever the
engine has nothing left to run, so its ``/v1/server_info`` stays current.

With one front end (the default) the router is not used: the pipes work as they always did.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

from fastdeploy.core.messages import (
    AbortRequest,
    AddRequest,
    Emit,
    EngineMessage,
    RequestFailed,
    StepOutputs,
    StopLoop,
)
from fastdeploy.core.outputs import EngineOutput
from fastdeploy.engine.engine_loop import Command

logger = logging.getLogger(__name__)

#: Seconds a front end's oldest unsent message may wait before the engine cuts that front end
#: off (its process has stopped reading: hung, stopped, swapping). Steps take milliseconds.
STUCK_S = 10.0
#: Seconds between the counters sent to a front end that has no outputs in the steps.
STATS_EVERY_S = 0.1


class CommandSink(Protocol):
    """Where a front end's commands go: the loop's queue, or a front end's inbox here."""

    def put(self, cmd: Command) -> None:
        """Queue ``cmd`` (never blocks)."""


class _Sender:
    """Sends one front end's messages, in order, from a thread of its own.

    ``emit(message)`` is the blocking sender of the pipe
    (:class:`~fastdeploy.engine.engine_core_proc.PipeEmitter`); ``put`` never blocks.
    :meth:`lag` is how long the oldest unsent message has waited; after :meth:`cut`, nothing
    more is sent and the pipe is closed once the send in progress returns.
    """

    def __init__(self, emit: Emit, name: str) -> None:
        self._emit = emit
        self._items: deque = deque()
        self._wake = threading.Condition(threading.Lock())
        self._sending_since: float | None = None
        self._cut = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, message: EngineMessage) -> None:
        with self._wake:
            if self._cut or self._closed:
                return
            self._items.append((time.monotonic(), message))
            self._wake.notify()

    def pending(self) -> int:
        """Messages queued or being sent."""
        return len(self._items) + (self._sending_since is not None)

    def lag(self, now: float) -> float:
        """Seconds the oldest message not yet sent has waited (0 when none waits)."""
        since = self._sending_since
        if since is None:
            items = self._items
            since = items[0][0] if items else None
        return 0.0 if since is None else now - since

    def cut(self) -> None:
        """Send nothing more; close the pipe once the send in progress (if any) returns."""
        with self._wake:
            self._cut = True
            self._items.clear()
            self._wake.notify()

    def close(self, timeout_s: float) -> None:
        """Send what is queued (waiting up to ``timeout_s``), then stop the thread."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._items and not self._cut and not self._closed:
                    self._wake.wait()
                if self._cut or not self._items:
                    break
                queued, message = self._items.popleft()
                self._sending_since = queued
            try:
                self._emit(message)
            except Exception:  # noqa: BLE001 - one bad message must not end this front end
                logger.exception(
                    "could not send a %s message to an API server", type(message).__name__
                )
            finally:
                self._sending_since = None
        if self._cut:
            conn = getattr(self._emit, "conn", None)
            if conn is not None:
                conn.close()


class _Inbox:
    """Where one front end's pump puts its commands (``put``, as on the loop's queue)."""

    __slots__ = ("index", "router")

    def __init__(self, router: FrontendRouter, index: int) -> None:
        self.router = router
        self.index = index

    def put(self, cmd: Command) -> None:
        self.router.command(self.index, cmd)


class FrontendRouter:
    """Routes commands from N front ends into one loop and the loop's messages back.

    Args:
        commands: the loop's command queue (``put``).
        make_emitter: ``make_emitter(inbox)`` -> the sender of one front end's messages
            (``emitter(message)``; it puts ``StopLoop`` into ``inbox`` when its pipe is
            closed), called once per front end, in order.
        num_frontends: N >= 2.

    Threads: :meth:`command` runs on the front ends' pump threads, :meth:`__call__` on the loop's
    thread, the sends on each front end's :class:`_Sender` thread (which calls :meth:`leave`
    when its pipe is closed); a lock guards the owner map and the set of front ends that left.

    Raises:
        ValueError: ``num_frontends`` < 2.
    """

    def __init__(
        self,
        commands: CommandSink,
        make_emitter: Callable[[CommandSink], Emit],
        num_frontends: int,
    ) -> None:
        if num_frontends < 2:
            raise ValueError(
                f"num_frontends={num_frontends} is invalid; allowed: >= 2 (one front end "
                "uses its pipes directly)"
            )
        self.commands = commands
        self.inboxes = [_Inbox(self, i) for i in range(num_frontends)]
        self._senders = [
            _Sender(make_emitter(inbox), f"fastdeploy-engine-send-{inbox.index}")
            for inbox in self.inboxes
        ]
        self._owners: dict[str, int] = {}
        self._left: set[int] = set()
        self._last_sent = [0.0] * num_frontends  # time.monotonic() of each one's last step
        self._lock = threading.Lock()

    @property
    def num_owned(self) -> int:
        """Requests in flight that the router knows the front end of."""
        return len(self._owners)

    # ------------------------------------------------------------------ commands (pump threads)
    def command(self, index: int, cmd: Command) -> None:
        """A command from front end ``index``: note who owns an added request, forget an aborted
        one; ``StopLoop`` means that front end leaves."""
        if isinstance(cmd, StopLoop):
            self.leave(index)
            return
        with self._lock:
            if index in self._left:
                return  # nothing of a front end that left reaches the loop
            if isinstance(cmd, AddRequest):
                owner = self._owners.get(cmd.request_id)
                if owner is not None:
                    self._senders[index].put(
                        RequestFailed(
                            cmd.request_id,
                            ValueError(
                                f"request id {cmd.request_id!r} is already in flight from API "
                                f"server {owner}; allowed: an id not in flight"
                            ),
                        )
                    )
                    return
                self._owners[cmd.request_id] = index
            elif isinstance(cmd, AbortRequest):
                self._owners.pop(cmd.request_id, None)
        self.commands.put(cmd)

    def leave(self, index: int) -> None:
        """Front end ``index`` is gone (``StopLoop`` or its pipe closed): abort what it owned;
        after the last one, stop the loop. Idempotent."""
        with self._lock:
            if index in self._left:
                return
            self._left.add(index)
            owned = [rid for rid, i in self._owners.items() if i == index]
            for rid in owned:
                del self._owners[rid]
            last = len(self._left) == len(self.inboxes)
        for rid in owned:
            self.commands.put(AbortRequest(rid))
        if owned:
            logger.warning("API server %d left; aborted its %d request(s)", index, len(owned))
        if last:
            self.commands.put(StopLoop())

    # ------------------------------------------------------------------ messages (loop thread)
    def __call__(self, message: EngineMessage) -> None:
        """Route one of the loop's messages (module docstring); the loop's thread."""
        match message:
            case StepOutputs(outputs, stats, now):
                self._step(outputs, stats, now)
            case RequestFailed(request_id):
                with self._lock:
                    index = self._owners.pop(request_id, None)
                    if index is not None and index not in self._left:
                        self._senders[index].put(message)
            case _:
                with self._lock:
                    for index, sender in enumerate(self._senders):
                        if index not in self._left:
                            sender.put(message)
        self._cut_stuck()

    def _step(self, outputs: list[EngineOutput], stats: dict, now: float) -> None:
        groups: dict[int, list] = {}
        idle = not stats.get("num_running") and not stats.get("num_waiting")
        with self._lock:
            owners = self._owners
            for o in outputs:
                index = owners.get(o.request_id)
                if index is None:
                    continue  # aborted by its front end since the step was launched
                group = groups.get(index)
                if group is None:
                    groups[index] = group = []
                group.append(o)
                if o.finished:
                    del owners[o.request_id]
            for index, sender in enumerate(self._senders):
                if index in self._left:
                    continue
                group = groups.get(index)
                if group is None and index != 0 and not idle:
                    if now - self._last_sent[index] < STATS_EVERY_S:
                        continue  # nothing of its own: the counters now and then
                sender.put(StepOutputs(group or [], stats, now))
                self._last_sent[index] = now

    def _cut_stuck(self) -> None:
        """Cut off each front end whose oldest unsent message has waited :data:`STUCK_S`."""
        now = time.monotonic()
        for index, sender in enumerate(self._senders):
            if index not in self._left and sender.lag(now) > STUCK_S:
                logger.error(
                    "API server %d has not read its messages for %.0f s; cut off (its requests "
                    "are aborted)",
                    index,
                    sender.lag(now),
                )
                self.leave(index)
                sender.cut()

    def pending(self) -> int:
        """Messages queued or being sent, over all front ends."""
        return sum(sender.pending() for sender in self._senders)

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued for each front end (up to ``timeout_s`` in all), then stop the
        sending threads; call before the pipes are closed."""
        deadline = time.monotonic() + timeout_s
        for sender in self._senders:
            sender.close(max(0.0, deadline - time.monotonic()))
