"""Persistent, maximum-size input buffers of the model runner and the per-step copy into them.

The buffers are allocated once; every step writes into them in place, so a CUDA graph replay reads
the same addresses that its capture saw. Padding rule (the only one): a step of ``n`` real
tokens run
as a bucket of ``padded`` tokens has rows ``n..padded-1`` with token id 0, position 0 and slot -1
(no KV written); their outputs are sliced off.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from fastdeploy.core.request import Request
from fastdeploy.core.sampling_params import SamplingParams
from fastdeploy.core.scheduler_output import ScheduledRequest, SchedulerOutput
from fastdeploy.model_executor.layers.attention.backend import AttentionBatch


@dataclass
class StepInputs:
    """Views of the persistent buffers for one step, plus host-side facts.

    Attributes:
        input_ids / positions: int64 ``[padded]`` views.
        batch: the attention batch (its tensors are views of the persistent buffers).
        logits_indices: int64 ``[num_sampling]``, rows whose hidden states are turned into logits.
        sampling_reqs: request ids aligned with ``logits_indices``.
        num_tokens / padded: real and padded token counts.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    batch: AttentionBatch
    logits_indices: torch.Tensor
    sampling_reqs: list[str]
    num_tokens: int
    padded: int


class InputBuffers:
    """Owner of the runner's persistent input tensors.

    Args:
        max_num_tokens: largest step in tokens (``max_num_batched_tokens``, or the largest capture
            bucket if larger).
        max_num_reqs: ``max_num_seqs``.
        max_blocks_per_seq: ``ceil(max_model_len / block_size)``.
        block_size: tokens per KV block.
        device: where the buffers live.
    """

    def __init__(
        self,
        max_num_tokens: int,
        max_num_reqs: int,
        max_blocks_per_seq: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.max_num_tokens = max_num_tokens
        self.max_num_reqs = max_num_reqs
        self.max_blocks_per_seq = max_blocks_per_seq
        self.block_size = block_size
        self.device = device
        pin = device.type == "cuda"

        def pair(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
            cpu = torch.zeros(shape, dtype=dtype, pin_memory=pin)
            return cpu, (torch.zeros(shape, dtype=dtype, device=device) if pin else cpu.clone())

        self.input_ids_cpu, self.input_ids = pair((max_num_tokens,), torch.int64)
        self.positions_cpu, self.positions = pair((max_num_tokens,), torch.int64)
        self.slot_mapping_cpu, self.slot_mapping = pair((max_num_tokens,), torch.int64)
        self.query_start_loc_cpu, self.query_start_loc = pair((max_num_reqs + 1,), torch.int32)
        self.seq_lens_cpu, self.seq_lens = pair((max_num_reqs,), torch.int32)
        self.block_tables_cpu, self.block_tables = pair(
            (max_num_reqs, max_blocks_per_seq), torch.int32
        )

    def prepare(self, sched: SchedulerOutput, padded: int | None = None) -> StepInputs:
        """Copy one scheduled step into the buffers (host numpy work, then one copy per buffer).

        Args:
            sched: the step; requests are laid out in ``sched.scheduled`` order.
            padded: token count to pad to (a capture bucket), or ``None`` for no padding.

        Raises:
            ValueError: the step exceeds the buffers (more tokens, requests or blocks than sized).
        """
        reqs = sched.scheduled
        num_reqs = len(reqs)
        query_lens = np.array([s.num_new_tokens for s in reqs], dtype=np.int64)
        starts = np.array([s.num_computed_tokens for s in reqs], dtype=np.int64)
        num_tokens = int(query_lens.sum())
        padded = num_tokens if padded is None else padded
        if padded > self.max_num_tokens or num_reqs > self.max_num_reqs:
            raise ValueError(
                f"step of {padded} tokens / {num_reqs} requests exceeds the runner's buffers "
                f"({self.max_num_tokens} tokens, {self.max_num_reqs} requests)"
            )
        cu = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(query_lens, out=cu[1:])
        seq_lens = starts + query_lens
        # positions: for token j of request i, starts[i] + (j - cu[i])
        req_of_token = np.repeat(np.arange(num_reqs), query_lens)
        positions = starts[req_of_token] + np.arange(num_tokens) - cu[req_of_token]

        ids = self.input_ids_cpu.numpy()
        for i, s in enumerate(reqs):
            a, b = s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens
            ids[cu[i] : cu[i + 1]] = _token_slice(s.request, a, b)
        ids[num_tokens:padded] = 0

        tables = self.block_tables_cpu.numpy()
        for i, s in enumerate(reqs):
            blocks = s.request.block_ids
            if len(blocks) > self.max_blocks_per_seq:
                raise ValueError(
                    f"request {s.request.request_id} holds {len(blocks)} blocks, more than "
                    f"max_blocks_per_seq={self.max_blocks_per_seq}"
                )
            tables[i, : len(blocks)] = blocks
            tables[i, len(blocks) :] = 0
        block_idx = tables[req_of_token, positions // self.block_size]
        slots = self.slot_mapping_cpu.numpy()
        slots[:num_tokens] = (
            block_idx.astype(np.int64) * self.block_size + positions % self.block_size
        )
        slots[num_tokens:padded] = -1
        self.positions_cpu.numpy()[:num_tokens] = positions
        self.positions_cpu.numpy()[num_tokens:padded] = 0
        self.query_start_loc_cpu.numpy()[: num_reqs + 1] = cu
        self.seq_lens_cpu.numpy()[:num_reqs] = seq_lens

        self._upload(padded, num_reqs)
        sampling = [i for i, s in enumerate(reqs) if s.samples]
        logits_idx = torch.tensor([int(cu[i + 1]) - 1 for i in sampling], dtype=torch.int64)
        batch = AttentionBatch(
            num_reqs=num_reqs,
            num_tokens=num_tokens,
            query_start_loc=self.query_start_loc[: num_reqs + 1],
            seq_lens=self.seq_lens[:num_reqs],
            block_tables=self.block_tables[:num_reqs],
            slot_mapping=self.slot_mapping[:padded],
            max_query_len=int(query_lens.max()) if num_reqs else 0,
            max_seq_len=int(seq_lens.max()) if num_reqs else 0,
            is_decode_only=sched.is_decode_only,
            query_lens_host=query_lens.tolist(),
            seq_lens_host=seq_lens.tolist(),
        )
        return StepInputs(
            input_ids=self.input_ids[:padded],
            positions=self.positions[:padded],
            batch=batch,
            logits_indices=logits_idx.to(self.device, non_blocking=True),
            sampling_reqs=[reqs[i].request.request_id for i in sampling],
            num_tokens=num_tokens,
            padded=padded,
        )

    def _upload(self, padded: int, num_reqs: int) -> None:
        if self.input_ids is self.input_ids_cpu:
            return
        for cpu, dev, n in (
            (self.input_ids_cpu, self.input_ids, padded),
            (self.positions_cpu, self.positions, padded),
            (self.slot_mapping_cpu, self.slot_mapping, padded),
            (self.query_start_loc_cpu, self.query_start_loc, num_reqs + 1),
            (self.seq_lens_cpu, self.seq_lens, num_reqs),
            (self.block_tables_cpu, self.block_tables, num_reqs),
        ):
            dev[:n].copy_(cpu[:n], non_blocking=True)


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


def rank_step(sched: SchedulerOutput) -> SchedulerOutput:
    """``sched`` as rank 0 sends it to the other ranks: the same layout over
    :class:`RankRequest` stand-ins; finished and preempted requests are left out (only rank 0
    keeps per-request state)."""
    scheduled = []
    for s in sched.scheduled:
        start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens
        request = s.request
        stand_in = RankRequest(
            request.request_id,
            list(request.block_ids),
            request.num_tokens,
            _token_slice(request, start, end),
        )
        scheduled.append(ScheduledRequest(stand_in, start, s.num_new_tokens))
    return SchedulerOutput(scheduled=scheduled)


def _token_slice(request, start: int, end: int) -> list[int]:
    """Token ids ``start:end`` of prompt + output without building the concatenated list."""
    if isinstance(request, RankRequest):
        return request.step_token_ids
    n_prompt = request.num_prompt_tokens
    if end <= n_prompt:
        return request.prompt_token_ids[start:end]
    if start >= n_prompt:
        return request.output_token_ids[start - n_prompt : end - n_prompt]
    return request.prompt_token_ids[start:] + request.output_token_ids[: end - n_prompt]


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
