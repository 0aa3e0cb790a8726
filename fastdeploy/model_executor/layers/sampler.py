"""Token sampling: logits processing, greedy, temperature, top-k, top-p, per-request seeds,
top-N log-probabilities."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from custom_ops.argmax_ops import argmax_rows
from fastdeploy.model_executor.layers.logits_processor import (
    LogitsProcessingMetadata,
    process_logits,
)


@dataclass
class SamplingMetadata:
    """Per-row sampling settings for one step, rows aligned with the logits.

    Attributes:
        temperature: float32 ``[N]``; 0 marks a greedy row. None (with ``top_p`` and ``top_k``)
            only when ``all_greedy``: the greedy path reads none of the three.
        top_p: float32 ``[N]`` in (0, 1].
        top_k: int64 ``[N]``; 0 disables top-k for that row.
        generators: per row, the request's own ``torch.Generator`` (a seeded request: its draws
            do not depend on its batch-mates, and its state lives as long as the request), or
            ``None`` to draw from ``generator``.
        generator: the engine's generator, for the rows without their own.
        all_greedy: every row is greedy (skips the random path).
        max_num_logprobs: largest ``logprobs`` asked for in the step, or ``None``.
        processing: the ``min_tokens`` mask, ``logit_bias`` and penalties of the step's rows, or
            ``None`` when no row uses any of them.
    """

    temperature: torch.Tensor | None
    top_p: torch.Tensor | None
    top_k: torch.Tensor | None
    generators: list[torch.Generator | None]
    generator: torch.Generator | None
    all_greedy: bool
    max_num_logprobs: int | None
    processing: LogitsProcessingMetadata | None = None


@dataclass
class SamplerOutput:
    """``token_ids`` int64 ``[N]``; with logprobs asked: ``logprobs`` float32 ``[N]`` of the chosen
    tokens and ``top_ids`` int64 / ``top_logprobs`` float32 ``[N, max_num_logprobs]``.

    ``token_ids`` may be the ``argmax`` the caller passed in, which for a full decode step is a
    CUDA graph's static output: queue every read of it before the next step's replay."""

    token_ids: torch.Tensor
    logprobs: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Mask ``logits`` ``[N, V]`` outside each row's top-k and nucleus (top-p) set with ``-inf``.

    Top-p keeps the smallest set of most likely tokens whose probability mass reaches ``top_p``
    (Holtzman et al. 2019, "The Curious Case of Neural Text Degeneration"); the most likely token
    is always kept.
    """
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device).expand_as(sorted_logits)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).unsqueeze(1)
    mask = ranks >= k
    probs = sorted_logits.masked_fill(mask, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    mask |= mass_before >= top_p.unsqueeze(1)
    mask[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_idx, sorted_logits)


class Sampler:
    """Picks one token per row of logits.

    First the logits processing of :mod:`~fastdeploy.model_executor.layers.logits_processor`
    (greedy rows included), then greedy rows take the argmax and random rows use the
    exponential-race form of categorical sampling (``argmax(p / q)`` with ``q ~ Exp(1)``), which
    needs no device-to-host sync and lets a seeded row draw from its own generator: one
    ``[V]`` draw per sampled token, so its stream depends only on its seed and its token count.
    """

    def __call__(
        self, logits: torch.Tensor, meta: SamplingMetadata, argmax: torch.Tensor | None = None
    ) -> SamplerOutput:
        """Sample from ``logits`` ``[N, V]`` (not modified; float32 as the LM head returns them:
        logits rounded to bf16 would turn near-ties into exact ties, which the argmax breaks
        towards the lower token id; other dtypes are upcast where probabilities are computed);
        returns token ids int64 ``[N]`` and, when asked, log-probabilities of the raw
        distribution (before temperature, penalties, ``logit_bias`` and the ``min_tokens`` mask,
        as vLLM reports them).

        ``argmax`` (int64 ``[N]``), when given, is ``logits``' row argmax already computed (a
        full decode graph computes it after the LM head): the greedy rows of a step without
        logits processing take it instead of launching the argmax again.
        """
        if meta.all_greedy and meta.processing is None and meta.max_num_logprobs is None:
            return SamplerOutput(token_ids=argmax if argmax is not None else argmax_rows(logits))
        logits = logits.float()
        if meta.max_num_logprobs is not None:
            logp = logits.log_softmax(dim=-1)
        if meta.processing is not None:
            logits = process_logits(logits, meta.processing)
            argmax = None  # the processed logits have an argmax of their own
        out = SamplerOutput(token_ids=argmax if argmax is not None else argmax_rows(logits))
        if not meta.all_greedy:
            greedy = meta.temperature == 0
            temp = torch.where(greedy, torch.ones_like(meta.temperature), meta.temperature)
            scaled = apply_top_k_top_p(logits / temp.unsqueeze(1), meta.top_k, meta.top_p)
            probs = scaled.softmax(dim=-1)
            q = torch.empty_like(probs).exponential_(generator=meta.generator)
            for row, gen in enumerate(meta.generators):
                if gen is not None:  # a seeded request: redraw its row from its own stream
                    q[row].exponential_(generator=gen)
            sampled = argmax_rows(probs / q)
            out.token_ids = torch.where(greedy, out.token_ids, sampled)
        if meta.max_num_logprobs is not None:
            out.logprobs = logp.gather(1, out.token_ids.unsqueeze(1)).squeeze(1)
            if meta.max_num_logprobs > 0:
                out.top_logprobs, out.top_ids = logp.topk(meta.max_num_logprobs, dim=-1)
        return out
