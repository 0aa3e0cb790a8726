"""The reference side: Hugging Face ``transformers`` in float32 on the harness's device.

For each prompt it keeps HF's greedy continuation (``generate``, cut at eos) and, from one
teacher-forced forward over prompt + that continuation, the log-probability of every prompt and
continuation token and HF's own top-2 margin at every continuation position. A divergence of ours
at continuation index ``j`` shares the prefix ``continuation[:j]`` with HF, so HF's row for that
position (context: prompt + common prefix) is in that same forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from accuracy.grammar import constrained_greedy
from accuracy.metrics import cut_at_eos

#: LM-head rows turned into float32 log-probs at once (a 2,000-token prompt of a 49K vocabulary
#: would otherwise hold 400 MB of logits).
LOGITS_CHUNK = 256


@dataclass(frozen=True)
class PromptReference:
    """HF float32 on one prompt.

    ``prompt_logprobs``: ``len(ids)`` entries, None at 0, else log p(ids[i] | ids[:i]) (nats).
    ``continuation``: greedy tokens, cut after the first eos. ``continuation_logprobs[j]`` and
    ``margins[j]``: log p of ``continuation[j]`` and the top-2 margin (nats) at that position.
    """

    ids: list[int]
    continuation: list[int]
    continuation_logprobs: list[float]
    margins: list[float]
    prompt_logprobs: list[float | None]


@dataclass(frozen=True)
class Reference:
    """HF float32 on a whole workload: one :class:`PromptReference` per prompt, and the
    teacher-forced log-probs of the perplexity text (None at position 0)."""

    prompts: list[PromptReference]
    text_logprobs: list[float | None]


def load_hf_gguf(directory: str, gguf_file: str, device: str) -> torch.nn.Module:
    """``AutoModelForCausalLM`` from the GGUF, dequantised to float32, in eval mode on device."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf_file, dtype=torch.float32)
    return hf.to(device).eval()


@torch.inference_mode()
def teacher_forced(
    hf: torch.nn.Module, ids: Sequence[int], margin_from: int
) -> tuple[list[float | None], list[float]]:
    """One forward over ``ids``.

    Returns ``(logprobs, margins)``: ``logprobs[i]`` = log p(ids[i] | ids[:i]) for i >= 1 (None
    at 0), and the top-2 margin of every row from ``margin_from`` to ``len(ids) - 2`` (the rows
    that predict ``ids[margin_from + 1:]``).
    """
    device = next(hf.parameters()).device
    x = torch.tensor([list(ids)], device=device)
    hidden = hf.model(input_ids=x).last_hidden_state[0]
    head = hf.get_output_embeddings()
    targets = x[0, 1:]
    logprobs: list[float | None] = [None]
    margins: list[float] = []
    for start in range(0, len(ids) - 1, LOGITS_CHUNK):
        stop = min(start + LOGITS_CHUNK, len(ids) - 1)
        lp = torch.log_softmax(head(hidden[start:stop]).float(), dim=-1)
        logprobs += lp.gather(1, targets[start:stop, None])[:, 0].tolist()
        first = max(margin_from - start, 0)
        if first < stop - start:
            top = lp[first:].topk(2, dim=-1).values
            margins += (top[:, 0] - top[:, 1]).tolist()
    return logprobs, margins


@torch.inference_mode()
def greedy(
    hf: torch.nn.Module, ids: Sequence[int], max_new_tokens: int, eos_ids: Sequence[int]
) -> list[int]:
    """HF's greedy continuation of ``ids`` (``generate``, no sampling), cut after eos."""
    device = next(hf.parameters()).device
    out = hf.generate(
        torch.tensor([list(ids)], device=device),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=device),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=list(eos_ids),
        pad_token_id=list(eos_ids)[0],
    )
    return cut_at_eos(out[0, len(ids) :].tolist(), eos_ids)


def build_reference(
    hf: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    text_ids: Sequence[int],
    max_new_tokens: int,
    eos_ids: Sequence[int],
    grammar: Any = None,
) -> Reference:
    """HF float32 greedy continuations and teacher-forced log-probs for every prompt, and the
    perplexity text's log-probs. Cost: one ``generate`` and one forward per prompt.

    With ``grammar`` (an xgrammar ``CompiledGrammar``, ``--json-schema``), the continuation is
    greedy under that grammar and its log-probs and margins are of the masked distribution
    (:func:`accuracy.grammar.constrained_greedy`); the prompt's log-probs are unchanged."""
    refs = []
    for ids in prompts:
        if grammar is None:
            cont = greedy(hf, ids, max_new_tokens, eos_ids)
            lps, margins = teacher_forced(hf, list(ids) + cont, margin_from=len(ids) - 1)
            cont_lps = [float(v) for v in lps[len(ids) :]]
        else:
            cont, cont_lps, margins = constrained_greedy(hf, ids, max_new_tokens, eos_ids, grammar)
            lps, _ = teacher_forced(hf, ids, margin_from=len(ids))
        refs.append(
            PromptReference(
                ids=list(ids),
                continuation=cont,
                continuation_logprobs=cont_lps,
                margins=margins,
                prompt_logprobs=lps[: len(ids)],
            )
        )
    text_logprobs, _ = teacher_forced(hf, text_ids, margin_from=len(text_ids))
    return Reference(prompts=refs, text_logprobs=text_logprobs)
