"""The scheduler's side of a step's output: :meth:`~StepOutputMixin.advance` applies a launched
step's counters (one output placeholder per request that samples), and
:meth:`~StepOutputMixin.resolve` turns the placeholders into the sampled tokens once they are on
the host. The serial step loop calls both at once (:meth:`~StepOutputMixin.update_from_output`);
the overlap schedule (:mod:`fastdeploy.engine.overlap`) schedules the next step in between. A
mixin of :class:`~fastdeploy.scheduler.scheduler.Scheduler`, which owns the requests and the KV
cache manager."""

from __future__ import annotations

import time

from fastdeploy.core.request import Request, RequestStatus
from fastdeploy.core.scheduler_output import ScheduledRequest, SchedulerOutput


class StepOutputMixin:
    """Step-output transitions of :class:`~fastdeploy.scheduler.scheduler.Scheduler`."""

    def update_from_output(
        self, output: SchedulerOutput, sampled_token_ids: dict[str, int]
    ) -> list[Request]:
        """Apply a finished step: :meth:`advance`, then :meth:`resolve` at once (the step loop
        without the overlap schedule).

        Args:
            output: what :meth:`schedule` returned for the step.
            sampled_token_ids: request id -> token id, exactly for the scheduled requests whose
                ``samples`` is true (requests aborted since may be present or not).

        Returns the requests that got a new token, in scheduled order; the engine checks their stop
        conditions and calls :meth:`finish_request`. Requests aborted since :meth:`schedule` are
        skipped.

        Raises:
            ValueError: a sampling request has no token, a token is given for a request that does
                not sample, or the output was already applied (nothing is changed then).
        """
        live = [s for s in output.scheduled if s.request.status == RequestStatus.RUNNING]
        self._check_not_applied(live)
        samplers = {s.request.request_id for s in output.scheduled if s.samples}
        sampling_ids = [s.request.request_id for s in live if s.samples]
        missing = [rid for rid in sampling_ids if rid not in sampled_token_ids]
        if missing:
            raise ValueError(f"no sampled token for requests {missing[:8]}")
        unexpected = sorted(set(sampled_token_ids) - samplers)
        if unexpected:
            raise ValueError(f"sampled tokens for requests that do not sample: {unexpected[:8]}")
        return self.resolve(self.advance(SchedulerOutput(scheduled=live)), sampled_token_ids)

    def advance(self, output: SchedulerOutput) -> list[Request]:
        """Apply a step as it is launched, before its tokens are known: advance each request's
        computed tokens (and its prompt-logprob rows), cache the full blocks of known tokens,
        and count one output placeholder per request that samples (the overlap schedule then
        schedules the next step from these counters while this one runs; :meth:`resolve`
        replaces the placeholders).

        Args:
            output: what :meth:`schedule` returned for the step (every request running).

        Returns:
            The requests that sample in the step, in scheduled order (pass them to
            :meth:`resolve`).

        Raises:
            ValueError: the step was already applied (nothing is changed then).
        """
        self._check_not_applied(output.scheduled)
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
        self.kv_cache_manager.cache_known_blocks(s.request for s in output.scheduled)
        return samplers

    def resolve(self, samplers: list[Request], sampled_token_ids: dict[str, int]) -> list[Request]:
        """A launched step's tokens arrived: each sampler's oldest placeholder becomes its token
        (appended to ``output_token_ids``), and the blocks it completes are cached.

        A request finished or aborted since :meth:`advance` is skipped: its token is dropped,
        never appended or emitted. A request preempted since keeps its token (it was sampled
        from its whole context) and re-prefills it with the rest.

        Args:
            samplers: what :meth:`advance` returned for the step.
            sampled_token_ids: request id -> token id, for at least the samplers still here.

        Returns:
            The requests that got a token, in ``samplers`` order; the engine checks their stop
            conditions.

        Raises:
            ValueError: a sampler still here has no token, or none pending (resolved twice).
        """
        requests, tokens = self._requests, sampled_token_ids
        live = [r for r in samplers if requests.get(r.request_id) is r]
        if any(r.num_output_placeholders < 1 or r.request_id not in tokens for r in live):
            _raise_unresolvable(live, tokens)  # checked before anything changes
        for request in live:
            request.num_output_placeholders -= 1
            request.output_token_ids.append(sampled_token_ids[request.request_id])
            if request.first_token_time is None:
                request.first_token_time = time.monotonic()
        running = RequestStatus.RUNNING  # a preempted request holds no block
        self.kv_cache_manager.cache_known_blocks(r for r in live if r.status == running)
        return live

    def _check_not_applied(self, scheduled: list[ScheduledRequest]) -> None:
        for s in scheduled:
            if s.request.num_computed_tokens != s.num_computed_tokens:
                raise ValueError(
                    f"request {s.request.request_id!r} has {s.request.num_computed_tokens} "
                    f"computed tokens, the output expects {s.num_computed_tokens}: applied twice?"
                )


def _raise_unresolvable(live: list[Request], sampled_token_ids: dict[str, int]) -> None:
    """The errors of :meth:`StepOutputMixin.resolve`, checked before anything changes.

    Raises:
        ValueError: a request with no sampled token, or with none pending.
    """
    missing = [r.request_id for r in live if r.request_id not in sampled_token_ids]
    if missing:
        raise ValueError(f"no sampled token for requests {missing[:8]}")
    unpending = [r.request_id for r in live if r.num_output_placeholders < 1]
    raise ValueError(f"requests {unpending[:8]} have no token pending: resolved twice?")
