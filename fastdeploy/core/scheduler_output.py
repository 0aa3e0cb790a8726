"""What the scheduler hands the model runner for one step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastdeploy.core.request import Request


@dataclass
class ScheduledRequest:
    """One request's share of a step.

    The step computes tokens ``request.all_token_ids[start : start + num_new_tokens]`` at positions
    ``start ..`` where ``start = num_computed_tokens`` (captured at scheduling time; the request's
    own counter is advanced only by :meth:`Scheduler.update_from_output`).
    """

    request: Request
    num_computed_tokens: int
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """True when this step reaches the request's last token, so a token is sampled (false
        for a non-final chunk of a chunked prefill). The last token may be a placeholder: one
        sampled by the step in flight (overlap schedule), fed to this one on the device."""
        end = self.num_computed_tokens + self.num_new_tokens
        return end == self.request.num_tokens_with_placeholders

    @property
    def prompt_logprob_rows(self) -> range:
        """The token positions of this step whose logits score the next prompt token (a
        request with ``prompt_logprobs``): position ``j`` scores prompt token ``j + 1``, so a
        chunk's last row scores the next chunk's first token and the prompt's last row none.
        Positions already scored (``Request.num_prompt_logprob_rows``: before a preemption, or
        by a step in flight) are left out, so each prompt position is computed once. Empty for
        every other request."""
        request = self.request
        if not request.num_prompt_logprob_rows_left:
            return range(0)
        start = max(self.num_computed_tokens, request.num_prompt_logprob_rows)
        end = min(self.num_computed_tokens + self.num_new_tokens, request.num_prompt_tokens - 1)
        return range(start, max(start, end))


@dataclass
class SchedulerOutput:
    """One step: running (decode) requests first, then newly admitted or resumed ones.

    ``finished_request_ids`` lists requests that left since the last step (finished, aborted), so
    the runner can drop per-request state; ``preempted`` lists requests preempted by recompute in
    this call (their blocks were freed and they will re-prefill).

    ``grammar_bitmask``: int32 ``[num_sampling_rows, ceil(vocab / 32)]`` on the host, one row per
    request that samples (in ``scheduled`` order), bit ``t`` set when token ``t`` is allowed;
    None when no sampling request has a structured-output grammar (set by the engine at launch,
    :mod:`fastdeploy.engine.structured_output`). Under the overlap schedule it can instead be a
    zero-argument callable returning that tensor (or None): the runner calls it once, after the
    step's forward is queued and before sampling (:mod:`fastdeploy.engine.step_pipeline`).
    """

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)
    grammar_bitmask: Any = None

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_decode_only(self) -> bool:
        """Every scheduled request adds exactly one token (host data, no device sync)."""
        return bool(self.scheduled) and all(s.num_new_tokens == 1 for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
