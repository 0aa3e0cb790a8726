"""Per-request sampling state of the model runner, in persistent slot-indexed buffers.

A request gets a slot the first time it samples and keeps it until it finishes or is aborted,
preemption included: its parameters, its seeded generator (whose state is the number of tokens
it drew), its output-token counts (penalties) and its prompt and stop-token masks stay in the
slot while it waits to be re-admitted, so a preempted request continues exactly where it
stopped. Parameters are written once, when the slot is taken: the new slots of a step are
written together, through pinned memory and device scatters. Each step only copies the row ->
slot indices and the ``min_tokens`` flags to the device, through persistent pinned buffers
(:class:`~fastdeploy.core.host_staging.StagingSets`), and gathers rows (fixed addresses and
shapes, no loop over the vocabulary), so the logits processing can later run inside a decode
CUDA graph; a step whose rows are the previous step's slots (a steady decode batch) copies only
flags that changed and reuses the gathered temperature, top-p and top-k. Nothing here waits for
the device.

Rows that need nothing on the device skip it. A step whose rows are all greedy, with no
``logit_bias``, penalties or ``min_tokens``, samples the argmax of its logits, which reads no slot
parameter: its rows are not gathered, and the parameters of the slots it takes are written on
the first later step that gathers (a non-greedy row or logits processing), since a slot's
parameters are those of its request for its life. Measured on an H200 host (SmolLM2-135M, 64
greedy streams served): ``prepare`` took 0.54 ms a step that admits requests (two device copies,
four scatters and fills, three gathers) and 0.13 ms a decode step whose rows changed.

Slots: ``max_num_seqs``. A request holds one from its first sampled token while it runs or waits
preempted; the scheduler admits no new request while a preempted one waits (preempted requests
go to the front of its FIFO queue), so running plus preempted requests never exceed
``max_num_seqs``.

The ``[slots, vocab]`` buffers (stop-token mask, prompt mask, output counts) are allocated on the
first request that needs them, so a deployment that never uses ``min_tokens`` or penalties does
not pay for them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fastdeploy.core.host_staging import StagingSets, to_device_async
from fastdeploy.core.request import Request
from fastdeploy.core.sampling_params import MAX_LOGIT_BIAS_ENTRIES
from fastdeploy.model_executor.layers.logits_processor import LogitsProcessingMetadata
from fastdeploy.model_executor.layers.sampler import SamplingMetadata

#: Columns of :attr:`SamplingBuffers.params` and the ``SamplingParams`` field of each.
_PARAM_COLUMNS = ("temperature", "top_p", "repetition", "frequency", "presence")
_PARAM_ATTRS = (
    "temperature",
    "top_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
)


@dataclass
class _Rows:
    """A step's row -> slot indices and what they determine, reused by the next step when its
    rows are the same slots (no slot taken or given back in between).

    Attributes:
        rows: the slot of each row; their device copy is ``SamplingBuffers._rows[:len(rows)]``.
        temperature / top_p / top_k: the slots' parameters gathered in row order, ``[N]``; None
            where no row needs them (all greedy, no logits processing: nothing was gathered).
        generators: the slots' seeded generators (None: the engine's).
        all_greedy / max_num_logprobs / any_bias / any_penalties / any_min_tokens: facts of the
            rows' sampling parameters, which a request keeps for its life.
    """

    rows: list[int]
    temperature: torch.Tensor | None
    top_p: torch.Tensor | None
    top_k: torch.Tensor | None
    generators: list[torch.Generator | None]
    all_greedy: bool
    max_num_logprobs: int | None
    any_bias: bool
    any_penalties: bool
    any_min_tokens: bool = True


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
        # One row of scalar parameters per slot, written in one scatter per step that admits
        # requests: temperature, top_p, repetition, frequency and presence penalties.
        self.params = torch.zeros((n, len(_PARAM_COLUMNS)), dtype=torch.float32, device=device)
        self.params[:, _PARAM_COLUMNS.index("top_p")] = 1
        self.params[:, _PARAM_COLUMNS.index("repetition")] = 1
        for i, name in enumerate(_PARAM_COLUMNS):
            setattr(self, name, self.params[:, i])  # views, gathered by slot
        self.top_k = torch.zeros(n, dtype=torch.int64, device=device)
        k = MAX_LOGIT_BIAS_ENTRIES
        self.bias_ids = torch.zeros((n, k), dtype=torch.int64, device=device)
        self.bias_values = torch.zeros((n, k), dtype=torch.float32, device=device)
        self._staging = StagingSets(
            {"rows": ((n,), torch.int64), "active": ((n,), torch.bool)}, device
        )
        self._rows = torch.zeros(n, dtype=torch.int64, device=device)
        self._active = torch.zeros(n, dtype=torch.bool, device=device)
        # [slots, vocab], allocated on first need (see the module docstring).
        self.stop_mask: torch.Tensor | None = None
        self.prompt_mask: torch.Tensor | None = None
        self.output_counts: torch.Tensor | None = None
        self._slot_of: dict[str, int] = {}
        # Slots taken whose parameters are not on the device yet: slot -> its request (written
        # by the first step that gathers; see the module docstring).
        self._unwritten: dict[int, Request] = {}
        self._free = list(range(n - 1, -1, -1))
        self._generators: list[torch.Generator | None] = [None] * n
        # The previous step's rows and min_tokens flags as on the device (see prepare); None
        # once a slot changed hands.
        self._last_rows: _Rows | None = None
        self._last_active: list[bool] | None = None

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
            self._unwritten.pop(slot, None)
            self._free.append(slot)
            self._last_rows = None

    def reset(self) -> None:
        """Free every slot and reseed the engine generator (after warm-up, so a seed gives the
        same output with and without graphs)."""
        for request_id in list(self._slot_of):
            self.free(request_id)
        self.generator.manual_seed(self.seed)

    def prepare(self, reqs: list[Request], vocab_size: int) -> SamplingMetadata:
        """The sampling metadata of one step's sampling rows ``reqs`` (in row order), taking a
        slot for each request that has none yet.

        A step whose rows hold the same slots as the previous step's, none newly taken (a
        steady decode batch), reuses that step's row -> slot indices on the device and its
        gathered temperature, top-p and top-k (slot parameters change only when a slot is
        taken); the ``min_tokens`` flags are copied only when they changed. A step of greedy
        rows without logits processing does no device work (module docstring).

        Args:
            reqs: the requests that sample this step, aligned with the logits rows.
            vocab_size: columns of the logits.

        Raises:
            RuntimeError: no slot is free (more requests alive than ``max_num_seqs``).
        """
        slot_of = self._slot_of
        rows, new = [], False
        for r in reqs:
            slot = slot_of.get(r.request_id)
            if slot is None:
                slot, new = self._take_slot(r), True
            rows.append(slot)
        state = self._last_rows
        same_rows = not new and state is not None and state.rows == rows
        if same_rows and not state.any_min_tokens:
            active = self._last_active  # all False, as no row has min_tokens (the common case)
        else:
            # Tokens still in flight (overlap schedule) count: this row samples after them.
            active = [
                len(r.output_token_ids) + r.num_output_placeholders < r.sampling_params.min_tokens
                for r in reqs
            ]
        if not same_rows:
            state = self._last_rows = self._gather_rows(reqs, rows, active, vocab_size)
        elif active != self._last_active:
            self._upload(None, active)
        self._last_active = active
        return SamplingMetadata(
            temperature=state.temperature,
            top_p=state.top_p,
            top_k=state.top_k,
            generators=state.generators,
            generator=self.generator,
            all_greedy=state.all_greedy,
            max_num_logprobs=state.max_num_logprobs,
            processing=self._processing(state, len(rows), any(active)),
        )

    def record(self, reqs: list[Request], token_ids: torch.Tensor) -> None:
        """Count this step's sampled tokens ``token_ids`` int64 ``[N]`` (device) in the output
        counts of their slots, rows aligned with ``reqs`` as given to :meth:`prepare`."""
        if self.output_counts is not None and reqs:
            slots = self._rows[: len(reqs)]
            ones = torch.ones_like(token_ids, dtype=self.output_counts.dtype)
            self.output_counts.index_put_((slots, token_ids), ones, accumulate=True)

    # ------------------------------------------------------------------ internals
    def _gather_rows(
        self, reqs: list[Request], rows: list[int], active: list[bool], vocab_size: int
    ) -> _Rows:
        """The facts of the rows' parameters (see :class:`_Rows`) and, unless every row is
        greedy without logits processing, the device work: write the slots not written yet,
        copy the row -> slot indices ``rows`` and the ``min_tokens`` flags ``active`` to the
        device and gather the slots' parameters."""
        params = [r.sampling_params for r in reqs]
        logprobs = [p.logprobs for p in params if p.logprobs is not None]
        state = _Rows(
            rows=rows,
            temperature=None,
            top_p=None,
            top_k=None,
            generators=[self._generators[s] for s in rows],
            all_greedy=all(p.greedy for p in params),
            max_num_logprobs=max(logprobs) if logprobs else None,
            any_bias=any(p.logit_bias for p in params),
            any_penalties=any(p.has_penalties for p in params),
            any_min_tokens=any(p.min_tokens for p in params),
        )
        if state.all_greedy and not (state.any_bias or state.any_penalties or state.any_min_tokens):
            if self.output_counts is not None:  # record() counts the tokens by slot
                self._upload(rows, active)
            return state
        if self._unwritten:
            self._write_slots([(r, slot) for slot, r in self._unwritten.items()], vocab_size)
            self._unwritten.clear()
        self._upload(rows, active)
        slots = self._rows[: len(rows)]
        state.temperature = self.temperature.index_select(0, slots)
        state.top_p = self.top_p.index_select(0, slots)
        state.top_k = self.top_k.index_select(0, slots)
        return state

    def _upload(self, rows: list[int] | None, active: list[bool]) -> None:
        """Copy ``rows`` (unless None) and ``active`` to the device through a pinned set, without
        a host wait."""
        staged = self._staging.next()
        n = len(active)
        if rows is not None:
            staged["rows"].numpy()[:n] = rows
            self._rows[:n].copy_(staged["rows"][:n], non_blocking=True)
        staged["active"].numpy()[:n] = active
        self._active[:n].copy_(staged["active"][:n], non_blocking=True)
        self._staging.copies_queued()

    def _processing(
        self, state: _Rows, n: int, any_active: bool
    ) -> LogitsProcessingMetadata | None:
        """The logits processing inputs of the step's ``n`` rows, gathered anew every step (the
        output counts change every step, the ``min_tokens`` flags as tokens come out)."""
        meta = LogitsProcessingMetadata()
        slots = self._rows[:n]
        if any_active and self.stop_mask is not None:
            meta.stop_mask = self.stop_mask.index_select(0, slots)
            meta.min_tokens_active = self._active[:n]
        if state.any_bias:
            meta.bias_ids = self.bias_ids.index_select(0, slots)
            meta.bias_values = self.bias_values.index_select(0, slots)
        if state.any_penalties:
            meta.prompt_mask = self.prompt_mask.index_select(0, slots)
            meta.output_counts = self.output_counts.index_select(0, slots)
            meta.repetition = self.repetition.index_select(0, slots)
            meta.frequency = self.frequency.index_select(0, slots)
            meta.presence = self.presence.index_select(0, slots)
        if meta.stop_mask is None and meta.bias_ids is None and meta.output_counts is None:
            return None
        return meta

    def _take_slot(self, request: Request) -> int:
        """Assign a free slot to ``request`` (host bookkeeping and its seeded generator; the
        parameters are written by :meth:`_write_slots` on the first step that gathers, also
        when a later request of the same step found no free slot)."""
        if not self._free:
            raise RuntimeError(
                f"no sampling slot is free for request {request.request_id!r}: all "
                f"{self.num_slots} are held by running or preempted requests"
            )
        slot = self._free.pop()
        self._slot_of[request.request_id] = slot
        self._unwritten[slot] = request  # written by the first step that gathers
        seed = request.sampling_params.seed
        if seed is not None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed)
            self._generators[slot] = gen
        return slot

    def _write_slots(self, new: list[tuple[Request, int]], vocab_size: int) -> None:
        """Write the parameters and masks of newly taken slots, batched: a few non-blocking
        copies through pinned memory and device scatters per step that admits requests, none
        per request and none that waits for the device."""
        dev = self.device
        slots = to_device_async([slot for _, slot in new], torch.int64, dev)
        values = np.array(
            [[getattr(r.sampling_params, a) for a in _PARAM_ATTRS] for r, _ in new], np.float32
        )
        top_k = [max(r.sampling_params.top_k, 0) for r, _ in new]
        self.params.index_copy_(0, slots, to_device_async(values, torch.float32, dev))
        self.top_k.index_copy_(0, slots, to_device_async(top_k, torch.int64, dev))
        self.bias_ids.index_fill_(0, slots, 0)
        self.bias_values.index_fill_(0, slots, 0)
        biased = [(r.sampling_params.logit_bias, i) for i, (r, _) in enumerate(new)]
        biased = [(bias, i) for bias, i in biased if bias]
        if biased:
            k = MAX_LOGIT_BIAS_ENTRIES
            ids = np.zeros((len(biased), k), dtype=np.int64)
            vals = np.zeros((len(biased), k), dtype=np.float32)
            for row, (bias, _) in enumerate(biased):
                ids[row, : len(bias)] = list(bias)
                vals[row, : len(bias)] = list(bias.values())
            at = slots.index_select(0, to_device_async([i for _, i in biased], torch.int64, dev))
            self.bias_ids.index_copy_(0, at, to_device_async(ids, torch.int64, dev))
            self.bias_values.index_copy_(0, at, to_device_async(vals, torch.float32, dev))
        stops = [(slot, sorted(r.min_tokens_stop_ids)) for r, slot in new if r.min_tokens_stop_ids]
        if stops:
            self.stop_mask = self._dense(self.stop_mask, vocab_size, torch.bool)
            self._set_rows(self.stop_mask, stops)
        penalized = [(r, slot) for r, slot in new if r.sampling_params.has_penalties]
        if penalized:
            self.prompt_mask = self._dense(self.prompt_mask, vocab_size, torch.bool)
            self.output_counts = self._dense(self.output_counts, vocab_size, torch.int32)
            self._set_rows(self.prompt_mask, [(s, r.prompt_token_ids) for r, s in penalized])
            # A PD decode leg starts with the prefill node's token: count it.
            self._set_rows(
                self.output_counts, [(s, r.output_token_ids) for r, s in penalized], count=True
            )

    def _dense(self, buf: torch.Tensor | None, vocab_size: int, dtype: torch.dtype):
        if buf is None:
            buf = torch.zeros((self.num_slots, vocab_size), dtype=dtype, device=self.device)
        return buf

    def _set_rows(
        self, buf: torch.Tensor, rows: list[tuple[int, list[int]]], count: bool = False
    ) -> None:
        """Clear rows ``slot`` of ``buf`` ``[slots, vocab]``, then set (bool) or count (int) the
        listed token ids in each: one index copy and two device scatters for all rows."""
        dev = self.device
        slots = [slot for slot, _ in rows]
        buf.index_fill_(0, to_device_async(slots, torch.int64, dev), 0)
        flat_rows = [slot for slot, ids in rows for _ in ids]
        if not flat_rows:
            return
        flat_cols = [t for _, ids in rows for t in ids]
        index = to_device_async([flat_rows, flat_cols], torch.int64, dev)
        ones = torch.ones(len(flat_rows), dtype=buf.dtype, device=dev)
        buf.index_put_((index[0], index[1]), ones, accumulate=count)
