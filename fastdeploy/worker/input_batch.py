"""Persistent, maximum-size input buffers of the model runner and the per-step copy into them.

The buffers are allocated once; every step writes into them in place, so a CUDA graph replay reads
the same addresses that its capture saw. Padding rule (the only one): a step of ``n`` real
tokens run as a bucket of ``padded`` tokens has rows ``n..padded-1`` with token id 0, position 0
and slot -1 (no KV written); their outputs are sliced off.

Host data goes through pinned buffers with non-blocking copies (no host sync). Under the overlap
schedule a request's last token may still be on the device (sampled by the step in flight): its
row is filled on the device from that step's sampled tokens (:class:`LastSampled`), after the
copies and before the forward or graph replay.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import ClassVar

import numpy as np
import torch

from fastdeploy.core.host_staging import PackedBuffers, StagingSets, remember
from fastdeploy.core.request import Request
from fastdeploy.core.sampling_params import SamplingParams
from fastdeploy.core.scheduler_output import ScheduledRequest, SchedulerOutput
from fastdeploy.model_executor.layers.attention.backend import AttentionBatch
from fastdeploy.worker.step_gather import (
    fill_block_tables,
    gather_step,
    token_positions,
    token_slice,
)


@dataclass
class StepInputs:
    """Views of the persistent buffers for one step, plus host-side facts.

    Attributes:
        input_ids / positions: int64 ``[padded]`` views.
        batch: the attention batch (its tensors are views of the persistent buffers).
        logits_indices: int64 ``[num_sampling]``, rows whose hidden states are turned into logits.
        sampling_reqs: request ids aligned with ``logits_indices``.
        sampling: the indices in the step's ``scheduled`` of those requests (the ones whose
            ``ScheduledRequest.samples`` is true when the step was prepared).
        num_tokens / padded: real and padded token counts.
        num_fed: token rows whose id came from the previous step's sampled tokens on the device
            (overlap schedule), not from the host.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    batch: AttentionBatch
    logits_indices: torch.Tensor
    sampling_reqs: list[str]
    num_tokens: int
    padded: int
    num_fed: int = 0
    sampling: list[int] = field(default_factory=list)


@dataclass
class LastSampled:
    """The latest step's sampled tokens, still on the device, for the overlap schedule: the next
    step's placeholder rows take their ids from here.

    Attributes:
        token_ids: int64 ``[num_sampling]`` on the device, the sampler's output (for a greedy
            full decode step, or a greedy piecewise step whose sampled rows come from a graph, a
            view of that graph's static argmax, overwritten by its next replay: the next step's
            ``prepare`` queues its read before its own replays).
        rows: request id -> row of ``token_ids``.
    """

    token_ids: torch.Tensor
    rows: dict[str, int]


#: Step shapes whose device views :meth:`InputBuffers._slices` keeps before it starts over.
MAX_CACHED_SLICES = 256


class InputBuffers:
    """Owner of the runner's persistent input tensors and of the pinned host buffers they are
    filled through (:class:`~fastdeploy.core.host_staging.StagingSets`: every copy is
    non-blocking, none waits for the device).

    Args:
        max_num_tokens: largest step in tokens (``max_num_batched_tokens``, or the largest capture
            bucket if larger).
        max_num_reqs: ``max_num_seqs``.
        max_blocks_per_seq: ``ceil(max_model_len / block_size)``.
        block_size: tokens per KV block.
        device: where the buffers live.
        max_model_len: the most tokens a request holds (None: its whole block table); the
            synthetic capture steps keep their positions below it.
    """

    def __init__(
        self,
        max_num_tokens: int,
        max_num_reqs: int,
        max_blocks_per_seq: int,
        block_size: int,
        device: torch.device,
        max_model_len: int | None = None,
    ) -> None:
        self.max_num_tokens = max_num_tokens
        self.max_num_reqs = max_num_reqs
        self.max_blocks_per_seq = max_blocks_per_seq
        self.block_size = block_size
        self.max_seq_tokens = min(max_model_len or max_blocks_per_seq * block_size,
                                  max_blocks_per_seq * block_size)  # fmt: skip
        self.device = device
        r, t = max_num_reqs, max_num_tokens
        w = max_blocks_per_seq
        # One allocation, a few copies a step (PackedBuffers: one where the buffers are small):
        # the per-request buffers and the block table first (its used rows merge with them into
        # one copy), then the per-token ones. Where the unused rows of a wide block table
        # (max_num_seqs x max_blocks_per_seq can be megabytes) or the unused tail of a per-token
        # buffer exceed MERGE_GAP_BYTES, that gap is not copied and the next part is a copy of
        # its own (up to four copies).
        self._packed = PackedBuffers(
            {
                "query_start_loc": (r + 1, torch.int32),
                "seq_lens": (r, torch.int32),
                "logits_indices": (r, torch.int64),
                "fed_rows": (r, torch.int64),
                "fed_from": (r, torch.int64),
                "block_tables": (r * w, torch.int32),
                "input_ids": (t, torch.int64),
                "positions": (t, torch.int64),
                "slot_mapping": (t, torch.int64),
            },
            device,
        )
        for name, view in self._packed.device_views.items():
            setattr(self, name, view)
        self.block_tables = self.block_tables.view(r, w)
        self._views: dict[int, dict[str, np.ndarray]] = {}
        self._slice_cache: dict[tuple[int, int, int], tuple[torch.Tensor, ...]] = {}
        # Per host set: the corner of its block table outside which it is all zeros
        # (fill_block_tables).
        self._table_dirty: dict[int, tuple[int, int]] = {}

    def prepare(
        self,
        sched: SchedulerOutput,
        padded: int | None = None,
        last_sampled: LastSampled | None = None,
    ) -> StepInputs:
        """Copy one scheduled step into the buffers (host numpy work into a pinned set, then
        one to four non-blocking copies of the packed buffers' used parts, the block table's
        rows among them; one where the buffers are small).

        The requests are read in one Python pass
        (:func:`~fastdeploy.worker.step_gather.gather_step`) into flat lists that a few
        whole-step numpy calls write into the pinned set: no numpy call per request, whose fixed
        cost (about 1 us) made up most of this method's host time at a large decode batch.

        A request whose last token is a placeholder (sampled by the step in flight, overlap
        schedule) gets that row from ``last_sampled`` with a device gather and scatter after the
        copies: the host never waits for it.

        Args:
            sched: the step; requests are laid out in ``sched.scheduled`` order.
            padded: token count to pad to (a capture bucket), or ``None`` for no padding.
            last_sampled: the previous step's tokens on the device, for placeholder rows.

        Raises:
            ValueError: the step exceeds the buffers (more tokens, requests or blocks than sized).
            RuntimeError: a placeholder row whose token ``last_sampled`` does not hold.
        """
        reqs = sched.scheduled
        num_reqs = len(reqs)
        query_lens_host = [s.num_new_tokens for s in reqs]
        cu_host = [0, *accumulate(query_lens_host)]  # lists: cheaper than numpy at a few rows
        num_tokens = cu_host[-1]
        padded = num_tokens if padded is None else padded
        if padded > self.max_num_tokens or num_reqs > self.max_num_reqs:
            raise ValueError(
                f"step of {padded} tokens / {num_reqs} requests exceeds the runner's buffers "
                f"({self.max_num_tokens} tokens, {self.max_num_reqs} requests)"
            )
        step = gather_step(reqs, last_sampled.rows if last_sampled is not None else None)
        self._check_block_tables(reqs, step.num_blocks)
        host = self._host_views(self._packed.next())
        seq_lens = np.array(step.seq_lens, dtype=np.int64)
        query_lens = np.array(query_lens_host, dtype=np.int64)
        cu = np.array(cu_host, dtype=np.int64)
        max_query_len = max(query_lens_host, default=0)
        decode_only = num_tokens == num_reqs and max_query_len == 1
        req_of_token, positions = token_positions(seq_lens, query_lens, cu, decode_only)

        ids = host["input_ids"]
        ids[:num_tokens] = step.token_ids
        ids[num_tokens:padded] = 0
        num_fed = len(step.fed_rows)
        host["fed_rows"][:num_fed] = step.fed_rows
        host["fed_from"][:num_fed] = step.fed_from

        tables = host["block_tables"]
        key = id(tables)  # one array per host set (_host_views)
        self._table_dirty[key] = fill_block_tables(
            tables, step.block_ids, step.num_blocks, self._table_dirty.get(key, tables.shape)
        )
        block_idx = tables[req_of_token, positions // self.block_size]
        slots = host["slot_mapping"]
        slots[:num_tokens] = (
            block_idx.astype(np.int64) * self.block_size + positions % self.block_size
        )
        slots[num_tokens:padded] = -1
        host["positions"][:num_tokens] = positions
        host["positions"][num_tokens:padded] = 0
        host["query_start_loc"][: num_reqs + 1] = cu
        host["seq_lens"][:num_reqs] = seq_lens
        num_sampling = len(step.sampling)
        last_rows = cu[1:] - 1  # each request's last token row
        if num_sampling < num_reqs:  # (all sample but non-final prefill chunks)
            last_rows = last_rows[step.sampling]
        host["logits_indices"][:num_sampling] = last_rows

        self._upload(padded, num_reqs, num_sampling, num_fed)
        if num_fed:
            fed = last_sampled.token_ids.index_select(0, self.fed_from[:num_fed])
            self.input_ids.index_copy_(0, self.fed_rows[:num_fed], fed)
        views = self._slices(num_reqs, padded, num_sampling)
        starts, lens, table, slot_mapping, input_ids, dev_positions, logits_indices = views
        batch = AttentionBatch(
            num_reqs=num_reqs,
            num_tokens=num_tokens,
            query_start_loc=starts,
            seq_lens=lens,
            block_tables=table,
            slot_mapping=slot_mapping,
            max_query_len=max_query_len,
            max_seq_len=max(step.seq_lens, default=0),
            is_decode_only=decode_only,
            query_lens_host=query_lens_host,
            seq_lens_host=step.seq_lens,
            block_tables_host=tables[:num_reqs],
        )
        return StepInputs(
            input_ids=input_ids,
            positions=dev_positions,
            batch=batch,
            logits_indices=logits_indices,
            sampling_reqs=step.sampling_reqs,
            num_tokens=num_tokens,
            padded=padded,
            num_fed=num_fed,
            sampling=step.sampling,
        )

    def _slices(self, num_reqs: int, padded: int, num_sampling: int) -> tuple[torch.Tensor, ...]:
        """The step's views of the device buffers (query start locations, sequence lengths,
        block table, slot mapping, input ids, positions, logits indices), made once per
        ``(num_reqs, padded, num_sampling)``: a step's shape repeats (a decode batch, a capture
        bucket), and slicing seven tensors costs about a microsecond each. The views share the
        buffers' memory, so a reused one reads the new step's values."""
        key = (num_reqs, padded, num_sampling)
        views = self._slice_cache.get(key)
        if views is None:
            views = (
                self.query_start_loc[: num_reqs + 1],
                self.seq_lens[:num_reqs],
                self.block_tables[:num_reqs],
                self.slot_mapping[:padded],
                self.input_ids[:padded],
                self.positions[:padded],
                self.logits_indices[:num_sampling],
            )
            remember(self._slice_cache, key, views, MAX_CACHED_SLICES)
        return views

    @property
    def staging_sets(self) -> list[StagingSets]:
        """The pinned host sets the buffers are filled through."""
        return [self._packed.staging]

    def _host_views(self, packed: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
        """Numpy views of one host set (the block table as ``[max_num_reqs,
        max_blocks_per_seq]``), made once per set (they share its memory)."""
        views = self._views.get(id(packed))
        if views is None:
            views = self._views[id(packed)] = {name: t.numpy() for name, t in packed.items()}
            views["block_tables"] = views["block_tables"].reshape(self.block_tables.shape)
        return views

    def _check_block_tables(self, reqs: list[ScheduledRequest], num_blocks: list[int]) -> None:
        """Raises ValueError naming the first request whose block table exceeds the buffer."""
        if num_blocks and max(num_blocks) > self.max_blocks_per_seq:
            i = next(i for i, n in enumerate(num_blocks) if n > self.max_blocks_per_seq)
            raise ValueError(
                f"request {reqs[i].request.request_id} holds {num_blocks[i]} blocks, more than "
                f"max_blocks_per_seq={self.max_blocks_per_seq}"
            )

    def _upload(self, padded: int, num_reqs: int, num_sampling: int, num_fed: int) -> None:
        """Queue this step's copies (no host wait): the used parts of the packed buffers, the
        block table's first ``num_reqs`` rows among them (one copy when the buffers are small,
        see :class:`PackedBuffers`)."""
        self._packed.upload(
            {
                "query_start_loc": num_reqs + 1,
                "seq_lens": num_reqs,
                "logits_indices": num_sampling,
                "fed_rows": num_fed,
                "fed_from": num_fed,
                "block_tables": num_reqs * self.max_blocks_per_seq,
                "input_ids": padded,
                "positions": padded,
                "slot_mapping": padded,
            }
        )


@dataclass
class RankRequest:
    """What a tensor-parallel rank other than 0 needs of one scheduled request: the few fields
    :meth:`InputBuffers.prepare` reads, and only this step's tokens (a whole ``Request`` would
    carry its history, sampling state and detokenizer over the wire every step).

    Attributes:
        request_id: the request's id.
        block_ids: its block table.
        num_tokens: its known tokens (so ``ScheduledRequest.samples`` answers as on rank 0).
        step_token_ids: the tokens this step computes, ``all_token_ids[start:start + new]``.
    """

    request_id: str
    block_ids: list[int]
    num_tokens: int
    step_token_ids: list[int]
    #: Tokens still on rank 0's device: none (the overlap schedule is off under tensor
    #: parallelism, and :func:`rank_step` refuses a request with any).
    num_output_placeholders: ClassVar[int] = 0

    @property
    def num_tokens_with_placeholders(self) -> int:
        """``num_tokens``: a step is sent to the other ranks with every token known (the
        overlap schedule is off under tensor parallelism)."""
        return self.num_tokens


def rank_step(sched: SchedulerOutput) -> SchedulerOutput:
    """``sched`` as rank 0 sends it to the other ranks: the same layout over
    :class:`RankRequest` stand-ins; finished and preempted requests are left out (only rank 0
    keeps per-request state)."""
    scheduled = []
    for s in sched.scheduled:
        start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens
        request = s.request
        if request.num_output_placeholders:
            raise RuntimeError(
                f"request {request.request_id!r} has a token still on rank 0's device; the "
                "overlap schedule must be off under tensor parallelism"
            )
        stand_in = RankRequest(
            request.request_id,
            list(request.block_ids),
            request.num_tokens,
            token_slice(request, start, end),
        )
        scheduled.append(ScheduledRequest(stand_in, start, s.num_new_tokens))
    return SchedulerOutput(scheduled=scheduled)


def dummy_step(
    sizes: Sequence[int],
    block_size: int,
    history: int = 0,
    share_block: bool = False,
    first_block: int = 1,
) -> SchedulerOutput:
    """A synthetic step for memory profiling, kernel warm-up, graph capture and benchmarks: one
    request per entry of ``sizes`` new tokens (token id 0) after ``history`` cached ones.

    Blocks are consecutive from ``first_block`` (block 0 is the reserved null block); with
    ``share_block`` every request uses block ``first_block`` only (decode capture: what is
    written there is garbage and never read as real KV).

    Args:
        sizes: new tokens per request, each >= 1.
        block_size: tokens per KV block.
        history: KV tokens each request already has (1 makes a one-token request a decode).
        share_block: all requests share one block.
        first_block: the first block id used.
    """
    sched = SchedulerOutput()
    block = first_block
    for i, n in enumerate(sizes):
        total = history + n
        nblocks = math.ceil(total / block_size)
        req = Request(f"dummy-{i}", [0] * total, SamplingParams(temperature=0, max_tokens=1))
        if share_block:
            req.block_ids = [first_block] * nblocks
        else:
            req.block_ids = list(range(block, block + nblocks))
            block += nblocks
        sched.scheduled.append(ScheduledRequest(req, history, n))
    return sched


def split_tokens(num_tokens: int, max_per_request: int) -> list[int]:
    """Split ``num_tokens`` into as few near-equal request sizes of at most ``max_per_request``
    as possible (a capture step larger than one request's block table)."""
    n = math.ceil(num_tokens / max_per_request)
    base, extra = divmod(num_tokens, n)
    return [base + (1 if i < extra else 0) for i in range(n)]
