"""Logits processing before sampling: the ``min_tokens`` mask, ``logit_bias`` and penalties.

Plain torch on ``[N, V]`` logits with per-row parameters that the model runner gathers from its
persistent, slot-indexed buffers (:class:`~fastdeploy.worker.sampling_buffers.SamplingBuffers`):
fixed shapes, no host sync and no Python loop over rows or the vocabulary, so the same code can
later run inside a decode CUDA graph, and it is the reference on CPU. Each part is skipped when no
row of the step uses it.

Order (vLLM's sampler): the ``min_tokens`` mask and ``logit_bias`` first, then the repetition,
frequency and presence penalties. The mask sets ``-inf``, which no later step can undo.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LogitsProcessingMetadata:
    """Per-row inputs of :func:`process_logits`, rows aligned with the logits; a part is None
    when no row of the step uses it.

    Attributes:
        stop_mask: bool ``[N, V]``: eos and ``stop_token_ids`` of each row.
        min_tokens_active: bool ``[N]``: the row has fewer than ``min_tokens`` output tokens, so
            its ``stop_mask`` tokens are masked out this step.
        bias_ids: int64 ``[N, K]`` token ids of ``logit_bias`` (unused entries: id 0, value 0).
        bias_values: float32 ``[N, K]``.
        prompt_mask: bool ``[N, V]``: the token occurs in the row's prompt.
        output_counts: int32 ``[N, V]``: times the token occurs in the row's output so far.
        repetition: float32 ``[N]`` repetition penalties (1: off).
        frequency: float32 ``[N]`` frequency penalties (0: off).
        presence: float32 ``[N]`` presence penalties (0: off).
    """

    stop_mask: torch.Tensor | None = None
    min_tokens_active: torch.Tensor | None = None
    bias_ids: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    prompt_mask: torch.Tensor | None = None
    output_counts: torch.Tensor | None = None
    repetition: torch.Tensor | None = None
    frequency: torch.Tensor | None = None
    presence: torch.Tensor | None = None


def apply_min_tokens_mask(
    logits: torch.Tensor, stop_mask: torch.Tensor, active: torch.Tensor
) -> torch.Tensor:
    """``logits`` float32 ``[N, V]`` with ``-inf`` where ``stop_mask`` bool ``[N, V]`` is set in
    the rows where ``active`` bool ``[N]`` is (those still under ``min_tokens``)."""
    return logits.masked_fill(stop_mask & active.unsqueeze(1), float("-inf"))


def apply_logit_bias(
    logits: torch.Tensor, bias_ids: torch.Tensor, bias_values: torch.Tensor
) -> torch.Tensor:
    """``logits`` float32 ``[N, V]`` plus ``bias_values`` float32 ``[N, K]`` at the columns
    ``bias_ids`` int64 ``[N, K]`` (OpenAI's ``logit_bias``; unused entries add 0 to token 0)."""
    return logits.scatter_add(1, bias_ids, bias_values)


def apply_penalties(
    logits: torch.Tensor,
    prompt_mask: torch.Tensor,
    output_counts: torch.Tensor,
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> torch.Tensor:
    """Repetition, frequency and presence penalties on ``logits`` float32 ``[N, V]``.

    ``repetition`` float32 ``[N]`` (vLLM's definition, from Keskar et al. 2019, "CTRL"): a token
    in the prompt (``prompt_mask`` bool ``[N, V]``) or the output (``output_counts`` int32
    ``[N, V]`` > 0) has its logit divided by the penalty when positive, multiplied when not.
    ``frequency`` and ``presence`` float32 ``[N]`` (OpenAI's definition): subtract
    ``frequency * count + presence * (count > 0)`` over the output tokens.
    """
    counts = output_counts.to(logits.dtype)
    seen = prompt_mask | (output_counts > 0)
    penalty = torch.where(seen, repetition.unsqueeze(1), torch.ones_like(logits))
    logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    logits = logits - frequency.unsqueeze(1) * counts
    return logits - presence.unsqueeze(1) * (counts > 0).to(logits.dtype)


def process_logits(logits: torch.Tensor, meta: LogitsProcessingMetadata) -> torch.Tensor:
    """Apply the parts of ``meta`` that are set, in this module's order, to ``logits`` float32
    ``[N, V]``; returns a new tensor (the input is not modified)."""
    if meta.stop_mask is not None:
        logits = apply_min_tokens_mask(logits, meta.stop_mask, meta.min_tokens_active)
    if meta.bias_ids is not None:
        logits = apply_logit_bias(logits, meta.bias_ids, meta.bias_values)
    if meta.output_counts is not None:
        logits = apply_penalties(
            logits,
            meta.prompt_mask,
            meta.output_counts,
            meta.repetition,
            meta.frequency,
            meta.presence,
        )
    return logits
