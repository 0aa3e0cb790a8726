"""One request's outputs on the server's asyncio side: the queue the engine loop's callback fills,
and the stream its consumer (an HTTP handler, ``AsyncLLMEngine.generate``) reads.

Part of :mod:`~.async_engine`; both classes run on the asyncio thread only.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from fastdeploy.entrypoints.engine_client.output_processor import RequestOutput


class RequestOutputs:
    """One request's outputs (or its error) waiting for its consumer: a deque and at most one
    waiting consumer. Lighter than ``asyncio.Queue`` (no size bound, one consumer), which matters
    at one put per stream per engine step. Asyncio thread only.

    ``last_only``: the consumer wants only the newest output (a non-streaming response): a put
    replaces what is queued and wakes the consumer only for a finished output or an error.
    """

    __slots__ = ("_items", "_waiter", "last_only")

    def __init__(self) -> None:
        self._items: deque = deque()
        self._waiter: asyncio.Future | None = None
        self.last_only = False

    def __len__(self) -> int:
        return len(self._items)

    def put(self, item: RequestOutput | BaseException) -> None:
        """Queue an output (or an exception) and wake the consumer."""
        if self.last_only and not isinstance(item, BaseException):
            self._items.clear()  # nothing but outputs is queued before an error
            self._items.append(item)
            if not item.finished:
                return
        else:
            self._items.append(item)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def wait(self) -> None:
        """Return once an item is queued; cancellation-safe (no item is taken)."""
        while not self._items:
            waiter = asyncio.get_running_loop().create_future()
            self._waiter = waiter
            try:
                await waiter
            finally:
                if self._waiter is waiter:
                    self._waiter = None

    def pop(self) -> RequestOutput | BaseException:
        """The oldest queued item."""
        return self._items.popleft()

    def take(self) -> list[RequestOutput | BaseException]:
        """Every queued item, oldest first; the queue is left empty."""
        items = list(self._items)
        self._items.clear()
        return items

    def put_back(self, item: RequestOutput | BaseException) -> None:
        """Return ``item`` to the front of the queue."""
        self._items.appendleft(item)


class Aborter(Protocol):
    """What a stream tells that its consumer left (the :class:`~.async_engine.AsyncLLMEngine`)."""

    def abort(self, request_id: str) -> None:
        """Abort the request unless it already finished."""


class RequestStream:
    """Async iterator over one request's ``RequestOutput`` objects, ending after the finished
    one (:meth:`next_batch` takes every output already there at once, :meth:`final` only the
    finished one). :meth:`close` aborts the
    request if it has not finished (its KV blocks are freed); it is also called when the stream
    is garbage-collected unfinished, so a consumer that vanishes before iterating still frees its
    request.

    Each output is the request's own object for that step (the output processor makes new ones
    every step), so a consumer that is a few steps behind reads every step's ``delta_text``."""

    def __init__(self, engine: Aborter, request_id: str, outputs: RequestOutputs) -> None:
        self.request_id = request_id
        self._engine = engine
        self._outputs = outputs
        self._done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        await self._outputs.wait()  # cancellation-safe: no item is lost
        item = self._outputs.pop()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if item.finished:
            self._done = True
        return item

    async def next_batch(self) -> list[RequestOutput]:
        """The outputs queued for this request, oldest first, waiting for at least one; ``[]``
        once the stream has ended. Raises the request's error (``ValueError`` from the engine,
        :class:`EngineDeadError`, ...) after every output that came before it was returned."""
        if self._done:
            return []
        await self._outputs.wait()  # cancellation-safe: no item is lost
        batch = self._outputs.take()
        last = batch[-1]
        if isinstance(last, BaseException):  # nothing is queued after an error
            if len(batch) > 1:  # raised on the next call
                self._outputs.put_back(last)
                return batch[:-1]
            self._done = True
            raise last
        if last.finished:  # nothing is queued after the finished output
            self._done = True
        return batch

    async def final(self) -> RequestOutput | None:
        """The finished output, skipping the ones before it (a non-streaming response): the
        consumer is woken once, when the request ends, not at every step. Raises what
        :meth:`next_batch` raises; None if the stream had already ended."""
        self._outputs.last_only = True
        last = None
        while batch := await self.next_batch():
            last = batch[-1]
        return last

    def close(self) -> None:
        """Abort the request unless it already finished. Idempotent."""
        if not self._done:
            self._done = True
            self._engine.abort(self.request_id)

    def __del__(self) -> None:
        self.close()
