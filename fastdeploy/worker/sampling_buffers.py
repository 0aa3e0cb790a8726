"""Per-request sampling state of the model runner, in persistent slot-indexed buffers.

A request gets a slot the first time it samples and keeps it until it finishes or is aborted,
preemption included: its parameters, its seeded generator (whose state is the number of tokens
it drew), its output-token counts (penalties) and its prompt and stop-token masks stay in the
slot while it waits to be re-admitted, so a preempted request continues exactly where it
stopped. Parameters are written once, when the slot is taken; each step only copies the row ->
slot indices and the ``min_tokens`` flags to the device and gathers rows (fixed addresses and
shapes, no loop over the vocabulary), so the logits processing can later run inside a decode
CUDA graph.

Slots: ``max_num_seqs``. A request holds one from its first sampled token while it runs or waits
preempted; the scheduler admits no new request while a preempted one waits (preempted requests
go to the front of its FIFO queue), so running plus preempted requests never exceed
``max_num_seqs``.

The ``[slots, vocab]`` buffers (stop-token mask, prompt mask, output counts) are allocated on the
first request that needs them, so a deployment that never uses ``min_tokens`` or penalties does
not pay for them.
"""

from __future__ import annotations

import numpy as np
import torch

from fastdeploy.core.request import Request
from fastdeploy.core.sampling_params import MAX_LOGIT_BIAS_ENTRIES, SamplingParams
from fastdeploy.model_executor.layers.logits_processor import LogitsProcessingMetadata
from fastdeploy.model_executor.layers.sampler import SamplingMetadata


class SamplingBuffers:
    """Owner of the per-request sampling state (see the module docstring).

    Args:
        max_num_reqs: slots (``max_num_seqs``).
        device: where the buffers live.
        seed: seed of the engine's generator, used by requests without a seed.
    """

    def __init__(self, max_num_reqs: int, device: torch.device, seed: int) -> None:
        self.num_slots = max_num_reqs
        self.device = device
        self.seed = seed
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        n = max_num_reqs
        self.temperature = torch.zeros(n, dtype=torch.float32, device=device)
        self.top_p = torch.ones(n, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(n, dtype=torch.int64, device=device)
        self.repetition = torch.ones(n, dtype=torch.float32, device=device)
        self.frequency = torch.zeros(n, dtype=torch.float32, device=device)
        self.presence = torch.zeros(n, dtype=torch.float32, device=device)
        k = MAX_LOGIT_BIAS_ENTRIES
        self.bias_ids = torch.zeros((n, k), dtype=torch.int64, device=device)
        self.bias_values = torch.zeros((n, k), dtype=torch.float32, device=device)
        pin = device.type == "cuda"
        self._rows_cpu = torch.zeros(n, dtype=torch.int64, pin_memory=pin)
        self._active_cpu = torch.zeros(n, dtype=torch.bool, pin_memory=pin)
        self._rows = torch.zeros(n, dtype=torch.int64, device=device)
        self._active = torch.zeros(n, dtype=torch.bool, device=device)
        # [slots, vocab], allocated on first need (see the module docstring).
        self.stop_mask: torch.Tensor | None = None
        self.prompt_mask: torch.Tensor | None = None
        self.output_counts: torch.Tensor | None = None
        self._slot_of: dict[str, int] = {}
        self._free = list(range(n - 1, -1, -1))
        self._generators: list[torch.Generator | None] = [None] * n

    @property
    def num_used_slots(self) -> int:
        """Slots held by requests (running or preempted)."""
        return len(self._slot_of)

    def slot_of(self, request_id: str) -> int | None:
        """The slot of a request, or None when it holds none."""
        return self._slot_of.get(request_id)

    def free(self, request_id: str) -> None:
        """Give back the slot of a finished or aborted request (no-op when it holds none)."""
        slot = self._slot_of.pop(request_id, None)
        if slot is not None:
            self._generators[slot] = None
            self._free.append(slot)

    def reset(self) -> None:
        """Free every slot and reseed the engine generator (after warm-up, so a seed gives the
        same output with and without graphs)."""
        for request_id in list(self._slot_of):
            self.free(request_id)
        self.generator.manual_seed(self.seed)

    def prepare(self, reqs: list[Request], vocab_size: int) -> SamplingMetadata:
        """The sampling metadata of one step's sampling rows ``reqs`` (in row order), taking a
        slot for each request that has none yet.

        Args:
            reqs: the requests that sample this step, aligned with the logits rows.
            vocab_size: columns of the logits.

        Raises:
            RuntimeError: no slot is free (more requests alive than ``max_num_seqs``).
        """
        n = len(reqs)
        rows = self._rows_cpu.numpy()
        active = self._active_cpu.numpy()
        for i, r in enumerate(reqs):
            slot = self._slot_of.get(r.request_id)
            rows[i] = self._take_slot(r, vocab_size) if slot is None else slot
            active[i] = len(r.output_token_ids) < r.sampling_params.min_tokens
        self._rows[:n].copy_(self._rows_cpu[:n], non_blocking=True)
        self._active[:n].copy_(self._active_cpu[:n], non_blocking=True)
        slots = self._rows[:n]
        params = [r.sampling_params for r in reqs]
        logprobs = [p.logprobs for p in params if p.logprobs is not None]
        return SamplingMetadata(
            temperature=self.temperature.index_select(0, slots),
            top_p=self.top_p.index_select(0, slots),
            top_k=self.top_k.index_select(0, slots),
            generators=[self._generators[s] for s in rows[:n].tolist()],
            generator=self.generator,
            all_greedy=all(p.greedy for p in params),
            max_num_logprobs=max(logprobs) if logprobs else None,
            processing=self._processing(params, slots, bool(active[:n].any())),
        )

    def record(self, reqs: list[Request], token_ids: torch.Tensor) -> None:
        """Count this step's sampled tokens ``token_ids`` int64 ``[N]`` (device) in the output
        counts of their slots, rows aligned with ``reqs`` as given to :meth:`prepare`."""
        if self.output_counts is not None and reqs:
            slots = self._rows[: len(reqs)]
            ones = torch.ones_like(token_ids, dtype=self.output_counts.dtype)
            self.output_counts.index_put_((slots, token_ids), ones, accumulate=True)

    # ------------------------------------------------------------------ internals
    def _processing(
        self, params: list[SamplingParams], slots: torch.Tensor, any_active: bool
    ) -> LogitsProcessingMetadata | None:
        meta = LogitsProcessingMetadata()
        if any_active and self.stop_mask is not None:
            meta.stop_mask = self.stop_mask.index_select(0, slots)
            meta.min_tokens_active = self._active[: len(params)]
        if any(p.logit_bias for p in params):
            meta.bias_ids = self.bias_ids.index_select(0, slots)
            meta.bias_values = self.bias_values.index_select(0, slots)
        if any(p.has_penalties for p in params):
            meta.prompt_mask = self.prompt_mask.index_select(0, slots)
            meta.output_counts = self.output_counts.index_select(0, slots)
            meta.repetition = self.repetition.index_select(0, slots)
            meta.frequency = self.frequency.index_select(0, slots)
            meta.presence = self.presence.index_select(0, slots)
        if meta.stop_mask is None and meta.bias_ids is None and meta.output_counts is None:
            return None
        return meta

    def _take_slot(self, request: Request, vocab_size: int) -> int:
        """Assign a free slot to ``request`` and write its parameters and masks there."""
        if not self._free:
            raise RuntimeError(
                f"no sampling slot is free for request {request.request_id!r}: all "
                f"{self.num_slots} are held by running or preempted requests"
            )
        slot = self._free.pop()
        self._slot_of[request.request_id] = slot
        p = request.sampling_params
        self.temperature[slot] = p.temperature
        self.top_p[slot] = p.top_p
        self.top_k[slot] = max(p.top_k, 0)
        self.repetition[slot] = p.repetition_penalty
        self.frequency[slot] = p.frequency_penalty
        self.presence[slot] = p.presence_penalty
        if p.seed is not None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(p.seed)
            self._generators[slot] = gen
        self.bias_ids[slot].zero_()
        self.bias_values[slot].zero_()
        if p.logit_bias:
            ids = np.zeros(MAX_LOGIT_BIAS_ENTRIES, dtype=np.int64)
            values = np.zeros(MAX_LOGIT_BIAS_ENTRIES, dtype=np.float32)
            ids[: len(p.logit_bias)] = list(p.logit_bias)
            values[: len(p.logit_bias)] = list(p.logit_bias.values())
            self.bias_ids[slot] = torch.from_numpy(ids)
            self.bias_values[slot] = torch.from_numpy(values)
        stop_ids = request.min_tokens_stop_ids
        if stop_ids:
            self.stop_mask = self._dense(self.stop_mask, vocab_size, torch.bool)
            self._set_row(self.stop_mask, slot, sorted(stop_ids))
        if p.has_penalties:
            self.prompt_mask = self._dense(self.prompt_mask, vocab_size, torch.bool)
            self.output_counts = self._dense(self.output_counts, vocab_size, torch.int32)
            self._set_row(self.prompt_mask, slot, request.prompt_token_ids)
            self.output_counts[slot].zero_()
            if request.output_token_ids:  # a PD decode leg starts with the prefill's token
                idx = torch.tensor(request.output_token_ids, dtype=torch.int64).to(self.device)
                self.output_counts[slot].index_add_(0, idx, torch.ones_like(idx, dtype=torch.int32))
        return slot

    def _dense(self, buf: torch.Tensor | None, vocab_size: int, dtype: torch.dtype):
        if buf is None:
            buf = torch.zeros((self.num_slots, vocab_size), dtype=dtype, device=self.device)
        return buf

    def _set_row(self, buf: torch.Tensor, slot: int, token_ids: list[int]) -> None:
        buf[slot].zero_()
        if token_ids:
            idx = torch.tensor(token_ids, dtype=torch.int64).to(self.device, non_blocking=True)
            buf[slot].index_fill_(0, idx, True)
