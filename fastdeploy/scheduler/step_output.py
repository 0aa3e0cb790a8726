"""The scheduler's side of a step's output, as functions over the requests and the KV cache
manager: :func:`advance` applies a launched step's counters (one output placeholder per request
that samples), and :func:`resolve` turns the placeholders into the sampled tokens once they are on
the host; :func:`check_sampled` is what the serial step loop checks before applying both at once.
The :class:`~fastdeploy.scheduler.scheduler.Scheduler` calls them from its methods of the same
names (the overlap schedule, :mod:`fastdeploy.engine.step_pipeline`, schedules the next step in
between).

Functions, not an object: this code keeps no state of its own; it moves counters on the requests
and caches their blocks, and the scheduler owns both."""

from __future__ import annotations

import time
from collections.abc import Mapping

from fastdeploy.cache_manager.kv_cache_manager import KVCacheManager
from fastdeploy.core.request import Request, RequestStatus
from fastdeploy.core.scheduler_output import ScheduledRequest, SchedulerOutput


def check_sampled(output: SchedulerOutput, sampled_token_ids: dict[str, int]) -> SchedulerOutput:
    """The part of ``output`` still running (requests aborted since :meth:`schedule` left out),
    after checking that ``sampled_token_ids`` holds exactly the tokens of its samplers.

    Raises:
        ValueError: a sampling request has no token, a token is given for a request that does
            not sample, or the output was already applied.
    """
    live = [s for s in output.scheduled if s.request.status == RequestStatus.RUNNING]
    check_not_applied(live)
    samplers = {s.request.request_id for s in output.scheduled if s.samples}
    sampling_ids = [s.request.request_id for s in live if s.samples]
    missing = [rid for rid in sampling_ids if rid not in sampled_token_ids]
    if missing:
        raise ValueError(f"no sampled token for requests {missing[:8]}")
    unexpected = sorted(set(sampled_token_ids) - samplers)
    if unexpected:
        raise ValueError(f"sampled tokens for requests that do not sample: {unexpected[:8]}")
    return SchedulerOutput(scheduled=live)


def advance(output: SchedulerOutput, kv_cache_manager: KVCacheManager) -> list[Request]:
    """Apply a step as it is launched (see :meth:`Scheduler.advance`).

    Returns:
        The requests that sample in the step, in scheduled order.

    Raises:
        ValueError: the step was already applied (nothing is changed then).
    """
    check_not_applied(output.scheduled)
    samplers = []
    for s in output.scheduled:
        request = s.request
        if s.samples:  # read before the counters move
            request.num_output_placeholders += 1
            samplers.append(request)
        if request.num_prompt_logprob_rows_left:  # this step's rows are computed
            request.num_prompt_logprob_rows = max(
                request.num_prompt_logprob_rows, s.prompt_logprob_rows.stop
            )
        request.num_computed_tokens += s.num_new_tokens
    kv_cache_manager.cache_known_blocks(s.request for s in output.scheduled)
    return samplers


def resolve(
    samplers: list[Request],
    sampled_token_ids: dict[str, int],
    requests: Mapping[str, Request],
    kv_cache_manager: KVCacheManager,
) -> list[Request]:
    """A launched step's tokens arrived (see :meth:`Scheduler.resolve`); ``requests`` are the
    scheduler's unfinished requests by id (a sampler not among them is skipped).

    Raises:
        ValueError: a sampler still here has no token, or none pending (resolved twice).
    """
    tokens = sampled_token_ids
    live = [r for r in samplers if requests.get(r.request_id) is r]
    if any(r.num_output_placeholders < 1 or r.request_id not in tokens for r in live):
        _raise_unresolvable(live, tokens)  # checked before anything changes
    for request in live:
        request.num_output_placeholders -= 1
        request.output_token_ids.append(sampled_token_ids[request.request_id])
        if request.first_token_time is None:
            request.first_token_time = time.monotonic()
    running = RequestStatus.RUNNING  # a preempted request holds no block
    kv_cache_manager.cache_known_blocks(r for r in live if r.status == running)
    return live


def check_not_applied(scheduled: list[ScheduledRequest]) -> None:
    """Raises ValueError when a request's computed tokens moved since it was scheduled (the
    step was applied already)."""
    for s in scheduled:
        if s.request.num_computed_tokens != s.num_computed_tokens:
            raise ValueError(
                f"request {s.request.request_id!r} has {s.request.num_computed_tokens} "
                f"computed tokens, the output expects {s.num_computed_tokens}: applied twice?"
            )


def _raise_unresolvable(live: list[Request], sampled_token_ids: dict[str, int]) -> None:
    """The errors of :func:`resolve`, checked before anything changes.

    Raises:
        ValueError: a request with no sampled token, or with none pending.
    """
    missing = [r.request_id for r in live if r.request_id not in sampled_token_ids]
    if missing:
        raise ValueError(f"no sampled token for requests {missing[:8]}")
    unpending = [r.request_id for r in live if r.num_output_placeholders < 1]
    raise ValueError(f"requests {unpending[:8]} have no token pending: resolved twice?")
