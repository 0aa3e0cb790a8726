"""The choices of one request: ``n`` per prompt, for one or several prompts, admitted so that each
prompt is prefilled once, and read back together (merged for a stream, collected for a body).

Choice ``j`` of prompt ``i`` has OpenAI's index ``i * n + j`` and is its own engine request. The
engine caches a full KV block in the prefix cache only once a step has written it
(``KVCacheManager.cache_full_blocks`` runs on the step's output), so ``n`` requests admitted
together would each prefill the whole prompt in the same step. Here the first choice of every
prompt is admitted first; the other ``n - 1`` are admitted once its first output arrived, i.e.
after the step that computed its whole prompt (and cached its full blocks) ran. They then find
every full block of the prompt in the prefix cache, and compute only the prompt's last partial
block and their own tokens. Nothing in the scheduler or the KV cache manager changes: each choice
is an ordinary request with its own block table (the shared blocks are reference-counted by the
block pool), aborted and freed on its own, so no new path can leak a block. Forking a request's
block table inside the engine (vLLM v0's sequence groups) would also skip the wait of one step
for the siblings' first token, but it needs a copy-on-write of the last partial block in the
scheduler and the KV cache manager, which the prefix cache makes unnecessary (vLLM v1 dropped the
fork for the same reason and fans ``n`` out into child requests:
vllm/v1/engine/parallel_sampling.py).

Seeds: choice ``j`` samples with ``seed + j`` (mod 2**64), as vLLM's ``ParentRequest`` derives a
child's seed from the parent's; choice 0 keeps the request's seed, so ``n=1`` answers as before.
The rule and the admission order are shared with the offline ``LLM``:
:mod:`fastdeploy.core.parallel_sampling`.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from fastapi import Request as HTTPRequest

from fastdeploy.core.parallel_sampling import choice_params
from fastdeploy.core.sampling_params import SamplingParams
from fastdeploy.entrypoints.engine_client.async_engine import RequestStream
from fastdeploy.entrypoints.openai.errors import bad_request
from fastdeploy.entrypoints.openai.serving_utils import DISCONNECT_POLL_S

#: Largest ``n`` a request may ask for (OpenAI's limit).
MAX_N = 128

#: ``admit(engine request id, prompt index, sampling params) -> stream``; raises ``APIError``.
Admit = Callable[[str, int, SamplingParams], RequestStream]


def check_n(
    n: int,
    num_prompts: int = 1,
    kv_transfer_params: Any = None,
    best_of: int | None = None,
    max_choices: int | None = None,
) -> None:
    """The rules of ``n`` (and of several prompts, and ``best_of``) for one request.

    Raises:
        APIError: 400 naming ``n`` when it is not in [1, :data:`MAX_N`]; naming ``best_of``
            when it is neither null nor ``n`` (``best_of > n`` would rank candidates by their
            log-probability, which is not implemented; below ``n`` it is invalid, as in
            OpenAI's API); naming ``n`` (or ``prompt``) when a PD leg (``kv_transfer_params``)
            asks for more than one choice (one leg is one request); naming ``n`` (or
            ``prompt``) when ``num_prompts * n`` exceeds ``max_choices`` (the server's limit of
            concurrent engine requests: such a request could never be admitted, so it is not a
            429 to retry).
    """
    if not 1 <= n <= MAX_N:
        raise bad_request(f"n={n} is invalid; allowed: an integer in [1, {MAX_N}]", "n")
    if best_of is not None and best_of != n:
        raise bad_request(
            f"best_of={best_of} is not supported with n={n}; allowed: null or {n} (the "
            "request's n)",
            "best_of",
        )
    if max_choices is not None and n * num_prompts > max_choices:
        raise bad_request(
            f"{num_prompts} prompt(s) x n={n} = {n * num_prompts} choices is invalid; allowed: "
            f"at most {max_choices} choices per request (the server's limit of concurrent "
            "requests, --max-concurrency)",
            "n" if n > 1 else "prompt",
        )
    if kv_transfer_params is not None and n * num_prompts > 1:
        param = "n" if n > 1 else "prompt"
        raise bad_request(
            f"kv_transfer_params (a PD leg) allows one prompt and n=1, got {num_prompts} "
            f"prompt(s) and n={n}",
            param,
        )


@dataclasses.dataclass
class Choice:
    """One choice: its OpenAI ``index``, its prompt's index, its engine request's stream, and
    whether it is its prompt's first choice (the one that prefills it). ``held``: outputs
    already taken from the stream (the first choice's first output, awaited before its siblings
    were admitted), returned first by :meth:`next_batch`."""

    index: int
    prompt_index: int
    stream: RequestStream
    first: bool = True
    held: list = dataclasses.field(default_factory=list)

    @property
    def request_id(self) -> str:
        return self.stream.request_id

    async def next_batch(self) -> list:
        """``RequestStream.next_batch``, the held outputs first."""
        if self.held:
            batch, self.held = self.held, []
            return batch
        return await self.stream.next_batch()

    async def final(self) -> Any:
        """The finished output (``RequestStream.final``), or the held one when it finished."""
        if self.held and self.held[-1].finished:
            return self.held[-1]
        self.held = []
        return await self.stream.final()


async def _until_disconnect(aws: Sequence[Any], raw_request: HTTPRequest | None) -> list | None:
    """The results of ``aws`` (gathered), or None if the client left first (polled every
    :data:`DISCONNECT_POLL_S` seconds, as uvicorn cancels no handler when its client goes)."""
    tasks = [asyncio.ensure_future(aw) for aw in aws]
    try:
        while True:
            done, pending = await asyncio.wait(
                tasks, timeout=DISCONNECT_POLL_S, return_when=asyncio.FIRST_EXCEPTION
            )
            for task in done:
                if task.exception() is not None:
                    raise task.exception()
            if not pending:
                return [t.result() for t in tasks]
            if raw_request is not None and await raw_request.is_disconnected():
                return None
    finally:
        for task in tasks:
            task.cancel()


async def open_choices(
    admit: Admit,
    request_id: str,
    num_prompts: int,
    n: int,
    params: SamplingParams,
    raw_request: HTTPRequest | None = None,
) -> list[Choice] | None:
    """Admit the ``num_prompts * n`` choices of a request, each prompt prefilled once (module
    docstring): the first choice of every prompt now, the others once that first choice's first
    output arrived. Engine request ids: ``request_id`` for a request of one choice, else
    ``f"{request_id}-{index}"``. Returns the choices ordered by index, or None when the client
    left while the first choices prefilled (every admitted choice is then aborted).

    Raises:
        APIError: what ``admit`` raises for any choice, or the engine's error of a first choice
            (every admitted choice is aborted first).
    """
    single = num_prompts * n == 1
    choices: list[Choice] = []

    def add(i: int, j: int) -> Choice:
        index = i * n + j
        rid = request_id if single else f"{request_id}-{index}"
        choice = Choice(index, i, admit(rid, i, choice_params(params, j)), first=j == 0)
        choices.append(choice)
        return choice

    try:
        firsts = [add(i, 0) for i in range(num_prompts)]
        if n > 1:
            batches = await _until_disconnect([c.stream.next_batch() for c in firsts], raw_request)
            if batches is None:
                close_all(choices)
                return None
            for choice, batch in zip(firsts, batches):
                choice.held = batch
            for i in range(num_prompts):
                for j in range(1, n):
                    add(i, j)
    except BaseException:
        close_all(choices)
        raise
    return sorted(choices, key=lambda c: c.index)


def close_all(choices: Sequence[Choice]) -> None:
    """Abort every choice that has not finished (``RequestStream.close``; idempotent)."""
    for choice in choices:
        choice.stream.close()


async def collect_finals(choices: Sequence[Choice], raw_request: HTTPRequest) -> list | None:
    """The finished output of every choice, in order; None (every choice aborted) if the client
    left first.

    Raises:
        What a choice's stream raises (the others are aborted).
    """
    try:
        return await _until_disconnect([c.final() for c in choices], raw_request)
    finally:
        close_all(choices)


class MergedStream:
    """The outputs of several choices as one stream (what :func:`~.sse.stream_events` reads):
    :meth:`next_batch` returns the outputs of every choice that has some, waiting for at least
    one, and ``[]`` once every choice finished. An output is told from another by its
    ``request_id`` (:attr:`index_of`). An error of one choice aborts the others and is raised;
    :meth:`close` aborts every unfinished choice."""

    def __init__(self, choices: Sequence[Choice]) -> None:
        self.choices = list(choices)
        self.index_of = {c.request_id: c.index for c in self.choices}
        self._tasks: dict[asyncio.Future, Choice] = {}
        self._live = list(self.choices)

    async def next_batch(self) -> list:
        """Outputs of the choices that have some, ordered by choice index."""
        for choice in self._live:
            self._tasks[asyncio.ensure_future(choice.next_batch())] = choice
        self._live = []
        if not self._tasks:
            return []
        done, _ = await asyncio.wait(set(self._tasks), return_when=asyncio.FIRST_COMPLETED)
        ready = sorted(((self._tasks.pop(t), t) for t in done), key=lambda ct: ct[0].index)
        outputs: list = []
        for choice, task in ready:
            if task.exception() is not None:
                self.close()
                raise task.exception()
            batch = task.result()
            outputs.extend(batch)
            if batch and not batch[-1].finished:
                self._live.append(choice)
        if not outputs:  # only choices that had already ended
            return await self.next_batch()
        return outputs

    def close(self) -> None:
        """Abort every unfinished choice and stop waiting for them. Idempotent."""
        for task in self._tasks:
            task.cancel()
        self._tasks.clear()
        self._live = []
        close_all(self.choices)


def merged(choices: Sequence[Choice]) -> tuple[Any, dict[str, int], set[str] | None]:
    """What a handler streams: ``(stream, {engine request id: choice index}, request ids of the
    first choice of each prompt)``. One choice streams its own ``RequestStream`` (no task per
    step: the common case, at many streams) and has None for the third item (its output counts
    alone, :class:`~fastdeploy.entrypoints.openai.sse.StreamUsage`); several stream through a
    :class:`MergedStream`."""
    if len(choices) == 1:
        return choices[0].stream, {choices[0].request_id: choices[0].index}, None
    firsts = {c.request_id for c in choices if c.first}
    return MergedStream(choices), {c.request_id: c.index for c in choices}, firsts
