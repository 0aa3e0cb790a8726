"""Prompt log-probabilities (vLLM's ``prompt_logprobs``): the teacher-forced log-probability of
each prompt token given the tokens before it, computed from a step's hidden states.

Only the rows of requests that asked are read: :func:`plan_prompt_logprobs` picks them from host
data (``ScheduledRequest.prompt_logprob_rows``), and :func:`compute_prompt_logprobs` runs the LM
head on those rows alone, eagerly, after the step's forward (a piecewise graph returns every
row's hidden state; no captured graph computes these logits), in float32: ``log_softmax``, the
prompt token's log-probability, its rank and the top ``k``. Rows go through the head in slices
of :data:`ROWS_PER_SLICE`, so a long prompt never holds ``[rows, vocab]`` float32 logits at once.

The result comes back as one float64 tensor (ids and float32 values are exact in float64), copied
to pinned host memory without a host wait on CUDA; the engine reads it with the step's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastdeploy.core.host_staging import record_event
from fastdeploy.core.scheduler_output import SchedulerOutput

#: Rows of hidden states turned into logits at once (``[ROWS_PER_SLICE, vocab]`` float32: 96 MiB
#: for a 49k vocabulary).
ROWS_PER_SLICE = 512


@dataclass
class PromptLogprobPlan:
    """Which hidden rows of a step score which prompt tokens (host data).

    Attributes:
        request_ids: requests with rows in this step, in step order.
        counts: rows of each request (aligned with ``request_ids``).
        num_tops: each request's ``prompt_logprobs`` (its top ``k``).
        rows: int64 hidden-state row indices, every request's in order (``sum(counts)``).
        targets: the prompt token each row scores (its position + 1), aligned with ``rows``.
    """

    request_ids: list[str]
    counts: list[int]
    num_tops: list[int]
    rows: list[int]
    targets: list[int]

    @property
    def num_top(self) -> int:
        """The largest ``k`` asked in the step (the width of the top-k columns)."""
        return max(self.num_tops)


def plan_prompt_logprobs(sched: SchedulerOutput) -> PromptLogprobPlan | None:
    """The step's prompt-logprob rows, or None when no scheduled request owes any (the common
    case: one attribute read per request). Tokens of a request are laid out in ``sched.scheduled``
    order, ``num_new_tokens`` rows each, as :meth:`InputBuffers.prepare` lays them out."""
    plan = None
    offset = 0
    for s in sched.scheduled:
        request = s.request
        if getattr(request, "num_prompt_logprob_rows_left", 0):  # rank stand-ins have none
            positions = s.prompt_logprob_rows
            if positions:
                if plan is None:
                    plan = PromptLogprobPlan([], [], [], [], [])
                base = offset - s.num_computed_tokens
                plan.request_ids.append(request.request_id)
                plan.counts.append(len(positions))
                plan.num_tops.append(request.sampling_params.prompt_logprobs)
                plan.rows.extend(base + j for j in positions)
                plan.targets.extend(
                    request.prompt_token_ids[positions.start + 1 : positions.stop + 1]
                )
        offset += s.num_new_tokens
    return plan


def compute_prompt_logprobs(
    compute_logits, hidden: torch.Tensor, plan: PromptLogprobPlan
) -> PromptLogprobOutput:
    """Score ``plan``'s rows of ``hidden`` and queue the copy of the result to the host.

    Args:
        compute_logits: the model's ``compute_logits`` (``[N, H]`` -> ``[N, V]`` logits).
        hidden: ``[padded, H]`` hidden states of the step (model dtype), read, not modified.
        plan: from :func:`plan_prompt_logprobs`.

    Returns:
        A :class:`PromptLogprobOutput` over a float64 ``[R, 3 + 2k]`` tensor (R rows): the
        prompt token's log-probability, its rank (1 + tokens with a strictly larger one, as
        vLLM), the token id, ``k`` top ids and ``k`` top log-probabilities, float32 values.
    """
    k = plan.num_top
    rows = torch.tensor(plan.rows, dtype=torch.int64).to(hidden.device, non_blocking=True)
    targets = torch.tensor(plan.targets, dtype=torch.int64).to(hidden.device, non_blocking=True)
    parts = []
    for lo in range(0, len(plan.rows), ROWS_PER_SLICE):
        idx, tgt = rows[lo : lo + ROWS_PER_SLICE], targets[lo : lo + ROWS_PER_SLICE]
        logp = compute_logits(hidden.index_select(0, idx)).float().log_softmax(dim=-1)
        chosen = logp.gather(1, tgt.unsqueeze(1))
        rank = (logp > chosen).sum(dim=1, keepdim=True) + 1
        columns = [chosen, rank, tgt.unsqueeze(1)]
        if k:
            top_lp, top_ids = logp.topk(k, dim=-1)
            columns += [top_ids, top_lp]
        parts.append(torch.cat([c.to(torch.float64) for c in columns], dim=1))
    packed = torch.cat(parts) if len(parts) > 1 else parts[0]
    return PromptLogprobOutput(plan, packed)


class PromptLogprobOutput:
    """A step's prompt log-probabilities on their way to the host: a pinned, non-blocking copy
    and an event on CUDA, the tensor itself on CPU.

    Args:
        plan: the rows' owners.
        packed: float64 ``[R, 3 + 2k]`` on the device (see :func:`compute_prompt_logprobs`).
    """

    def __init__(self, plan: PromptLogprobPlan, packed: torch.Tensor) -> None:
        self.plan = plan
        self._event = None
        if packed.device.type == "cuda":
            host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            host.copy_(packed, non_blocking=True)
            self._event = torch.cuda.Event()
            record_event(self._event)
            packed = host
        self._host = packed

    def entries(self) -> dict[str, list[dict]]:
        """Wait for the copy; request id -> its entries in position order, each
        ``{"token_id", "logprob", "rank", "top_logprobs": [(id, logprob)] * k}`` with the
        request's own ``k``."""
        if self._event is not None:
            self._event.synchronize()
        values = self._host.tolist()
        k = self.plan.num_top
        out: dict[str, list[dict]] = {}
        i = 0
        for rid, count, num_top in zip(self.plan.request_ids, self.plan.counts, self.plan.num_tops):
            entries = []
            for row in values[i : i + count]:
                top = [
                    (int(t), lp)
                    for t, lp in zip(row[3 : 3 + num_top], row[3 + k : 3 + k + num_top])
                ]
                entries.append(
                    {"token_id": int(row[2]), "logprob": row[0], "rank": int(row[1]),
                     "top_logprobs": top}
                )  # fmt: skip
            out[rid] = entries
            i += count
        return out
