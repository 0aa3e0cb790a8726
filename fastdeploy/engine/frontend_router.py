"""One engine process serving several API server processes (``--api-server-count N``, vLLM's
flag): the engine process's side.

Each API server process (a front end) has its own pair of pipes to the engine process. The
commands of all of them go into the one queue that
:class:`~fastdeploy.engine.engine_loop.EngineLoop` drains, and :class:`FrontendRouter` remembers
which front end added each request, so that the loop's messages go back to where they belong:

* ``step``: each front end gets its own requests' outputs, with the step's counters and time;
  front end 0 (the primary, which exports the engine's counters) gets every step's message, the
  others only the steps that have outputs of theirs;
* ``fail``: to the request's front end;
* ``stats``, ``dead``, ``ready``, ``error``: to every front end.

A front end leaves by ``StopLoop`` (its graceful shutdown) or by its pipe closing (it died); the
router then aborts the requests it still owned, so their KV blocks are freed, and once every front
end has left the loop gets ``StopLoop``. A request id that another front end already has in
flight is refused (``fail`` with a ``ValueError``) instead of taking over its outputs.

With one front end (the default) the router is not used: the pipes work as they always did.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from fastdeploy.engine.engine_loop import AbortRequest, AddRequest, StopLoop

logger = logging.getLogger(__name__)


class _Inbox:
    """Where one front end's pump puts its commands (``put``, as on the loop's queue)."""

    __slots__ = ("index", "router")

    def __init__(self, router: FrontendRouter, index: int) -> None:
        self.router = router
        self.index = index

    def put(self, cmd: Any) -> None:
        self.router.command(self.index, cmd)


class FrontendRouter:
    """Routes commands from N front ends into one loop and the loop's messages back.

    Args:
        commands: the loop's command queue (``put``).
        make_emitter: ``make_emitter(inbox)`` -> the sender of one front end's messages
            (``emitter(kind, *args)``; it puts ``StopLoop`` into ``inbox`` when its pipe is
            closed), called once per front end, in order.
        num_frontends: N >= 2.

    Threads: :meth:`command` runs on the front ends' pump threads, :meth:`__call__` on the loop's
    thread; a lock guards the owner map and serialises the sends to each front end.

    Raises:
        ValueError: ``num_frontends`` < 2.
    """

    def __init__(
        self,
        commands: Any,
        make_emitter: Callable[[Any], Callable[..., None]],
        num_frontends: int,
    ) -> None:
        if num_frontends < 2:
            raise ValueError(
                f"num_frontends={num_frontends} is invalid; allowed: >= 2 (one front end "
                "uses its pipes directly)"
            )
        self.commands = commands
        self.inboxes = [_Inbox(self, i) for i in range(num_frontends)]
        self._emitters = [make_emitter(inbox) for inbox in self.inboxes]
        self._owners: dict[str, int] = {}
        self._left: set[int] = set()
        # Re-entrant: a send that finds its pipe closed makes that front end leave, inside the
        # send.
        self._lock = threading.RLock()

    @property
    def num_owned(self) -> int:
        """Requests in flight that the router knows the front end of."""
        return len(self._owners)

    # ------------------------------------------------------------------ commands (pump threads)
    def command(self, index: int, cmd: Any) -> None:
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
                    self._emitters[index](
                        "fail",
                        cmd.request_id,
                        ValueError(
                            f"request id {cmd.request_id!r} is already in flight from API "
                            f"server {owner}; allowed: an id not in flight"
                        ),
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
    def __call__(self, kind: str, *args: Any) -> None:
        if kind == "step":
            self._step(*args)
        elif kind == "fail":
            with self._lock:
                index = self._owners.pop(args[0], None)
                if index is not None and index not in self._left:
                    self._emitters[index](kind, *args)
        else:
            with self._lock:
                for index, emit in enumerate(self._emitters):
                    if index not in self._left:
                        emit(kind, *args)

    def _step(self, outputs: list, stats: dict, now: float) -> None:
        groups: dict[int, list] = {}
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
            for index, emit in enumerate(self._emitters):
                group = groups.get(index)
                if index in self._left or (group is None and index != 0):
                    continue
                emit("step", group or [], stats, now)
