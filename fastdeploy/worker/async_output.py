"""Sampled tokens on their way to the host: one pinned, non-blocking copy and one event per step.

The sampler leaves a step's token ids (and, when asked, log-probabilities) on the device.
:class:`OutputStager` queues ONE device-to-host copy of them into a pinned host buffer and
records ONE event after it; :class:`PendingOutput` is the handle the engine keeps. The host waits
on that event only, in :meth:`PendingOutput.result`: under the overlap schedule after it has
launched the next step, so the device never idles while the host reads the tokens.

With log-probabilities the rows are packed into one float64 tensor first (token ids and float32
log-probabilities are exact in float64), so there is still one copy.

Two host buffers alternate: the copy of step N+1 may be queued while the host still reads step
N. On CPU the tensors are read directly (the "device" finished when the sampler returned).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastdeploy.core.host_staging import record_event
from fastdeploy.core.sampling_params import MAX_LOGPROBS
from fastdeploy.model_executor.layers.sampler import SamplerOutput


@dataclass
class SampledToken:
    """One sampled token; ``top_logprobs`` is ``[(token_id, logprob), ...]`` when asked."""

    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


class PendingOutput:
    """A step's sampled tokens: on the host once the step's event completed.

    Args:
        request_ids: the sampling requests, aligned with the rows.
        host: int64 ``[N]`` token ids, or float64 ``[N, 2 + 2k]`` packed rows (token id,
            logprob, ``k`` top ids, ``k`` top logprobs); pinned host memory on CUDA.
        num_top: ``k`` (0: no top log-probabilities), or None when no log-probability was asked.
        event: recorded after the copy into ``host`` (None on CPU).

    Attributes:
        prompt_logprobs: the step's prompt log-probabilities
            (:class:`~fastdeploy.worker.prompt_logprobs.PromptLogprobOutput`), or None when no
            request of the step owed any.
    """

    def __init__(
        self,
        request_ids: list[str],
        host: torch.Tensor | None,
        num_top: int | None,
        event: torch.cuda.Event | None,
    ) -> None:
        self.request_ids = request_ids
        self._host = host
        self._num_top = num_top
        self._event = event
        self._result: dict[str, SampledToken] | None = None
        self._token_ids: dict[str, int] | None = None
        self.prompt_logprobs = None

    @classmethod
    def ready(cls, tokens: dict[str, SampledToken]) -> PendingOutput:
        """An output already on the host (an empty step, a rank that does not sample)."""
        out = cls(list(tokens), None, None, None)
        out._result = tokens
        return out

    @property
    def done(self) -> bool:
        """The host has read the tokens (its buffer may be reused)."""
        return self._host is None

    def result(self) -> dict[str, SampledToken]:
        """Wait for the step's event (the step's one host wait), then request id -> token.

        Idempotent: later calls return the same dict without waiting.
        """
        if self._result is None:
            if self._num_top is None:  # token ids only
                self._result = {rid: SampledToken(t) for rid, t in self.token_ids().items()}
            else:
                self._wait()
                self._result = self._read_packed()
                self._host = None
        return self._result

    def token_ids(self) -> dict[str, int]:
        """Request id -> sampled token id: :meth:`result`'s tokens without their
        log-probabilities. Without log-probabilities it is read straight from the host buffer,
        with no :class:`SampledToken` per row (the step loop's common case: 3 us instead of 13
        us for 64 rows on one CPU core). Idempotent, like :meth:`result`."""
        if self._token_ids is None:
            if self._result is not None or self._num_top is not None:  # ready(), or packed rows
                self._token_ids = {rid: tok.token_id for rid, tok in self.result().items()}
            else:
                self._wait()
                self._token_ids = dict(zip(self.request_ids, self._host.tolist()))
                self._host = None
        return self._token_ids

    def _wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()

    def _read_packed(self) -> dict[str, SampledToken]:
        """The packed float64 rows (token id, logprob, ``k`` top ids, ``k`` top logprobs)."""
        k = self._num_top
        result = {}
        for rid, row in zip(self.request_ids, self._host.tolist()):
            top = None
            if k:
                top = [(int(t), lp) for t, lp in zip(row[2 : 2 + k], row[2 + k : 2 + 2 * k])]
            result[rid] = SampledToken(int(row[0]), row[1], top)
        return result


class OutputStager:
    """Owner of the pinned host buffers that sampled tokens come back through.

    Args:
        max_num_reqs: most sampling rows of a step (``max_num_seqs``).
        device: the sampler's device.
    """

    def __init__(self, max_num_reqs: int, device: torch.device) -> None:
        self.is_async = device.type == "cuda"
        self.max_num_reqs = max_num_reqs
        self._tokens: list[torch.Tensor] = []
        self._packed: list[torch.Tensor] = []  # allocated on the first step with logprobs
        self._owners: list[PendingOutput | None] = [None, None]
        self._index = 0
        if self.is_async:
            self._tokens = [
                torch.empty(max_num_reqs, dtype=torch.int64, pin_memory=True) for _ in range(2)
            ]

    def stage(self, out: SamplerOutput, request_ids: list[str]) -> PendingOutput:
        """Queue the copy of ``out`` (rows aligned with ``request_ids``) and record its event.

        Raises:
            ValueError: more rows than ``max_num_reqs``.
        """
        n = len(request_ids)
        if n > self.max_num_reqs:
            raise ValueError(f"{n} sampled rows exceed max_num_reqs={self.max_num_reqs}")
        rows, num_top = out.token_ids, None
        if out.logprobs is not None:
            num_top = out.top_ids.shape[1] if out.top_ids is not None else 0
            columns = [out.token_ids.unsqueeze(1), out.logprobs.unsqueeze(1)]
            if num_top:
                columns += [out.top_ids, out.top_logprobs]
            rows = torch.cat([c.to(torch.float64) for c in columns], dim=1)
        if not self.is_async:
            return PendingOutput(request_ids, rows, num_top, None)
        self._index ^= 1
        owner = self._owners[self._index]
        if owner is not None and not owner.done:
            owner.result()  # read before its buffer is reused (not reached in the step loop)
        if num_top is None:
            host = self._tokens[self._index][:n]
        else:
            if not self._packed:
                width = 2 + 2 * MAX_LOGPROBS
                self._packed = [
                    torch.empty(self.max_num_reqs * width, dtype=torch.float64, pin_memory=True)
                    for _ in range(2)
                ]
            host = self._packed[self._index][: rows.numel()].view(rows.shape)
        host.copy_(rows, non_blocking=True)
        event = torch.cuda.Event()
        record_event(event)
        pending = PendingOutput(request_ids, host, num_top, event)
        self._owners[self._index] = pending
        return pending
