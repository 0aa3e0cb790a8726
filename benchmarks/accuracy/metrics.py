"""The accuracy measures and rules of ``docs/accuracy.md`` as pure functions (no model, no torch).

Units: log-probabilities are natural-log (nats). A top-2 margin is ``logprob[top1] -
logprob[top2]`` of one row, which equals the logit gap ``logit[top1] - logit[top2]``: log-softmax
subtracts the same log-sum-exp from every logit of a row. So :data:`NEAR_TIE` reads the same in
logit units and in log-prob units.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

#: float32 rule: mean |Δ logprob| of teacher-forced prompt tokens against HF float32, nats.
FLOAT32_MAX_MEAN_DELTA = 1e-3
#: The near-tie bound on random weights (``tests/gpu/gpu_utils.py`` ``NEAR_TIE``, logits, measured
#: on an H200); here the floor of the bfloat16 bound (:func:`near_tie_bound`), and the bound itself
#: when the torch path was not run.
NEAR_TIE = 0.06
#: The bfloat16 bound in standard deviations of the yardstick's top-2 gap error
#: (:func:`near_tie_bound`).
NEAR_TIE_SIGMAS = 3.0
#: bfloat16 rule: a fast path's mean |Δ logprob| may exceed the plain torch path's (same dtype)
#: by at most this fraction.
MAX_REL_EXCESS_OVER_TORCH = 0.10
FLOAT32_DTYPES = ("float32",)


def cut_at_eos(tokens: Sequence[int], eos_ids: Iterable[int]) -> list[int]:
    """``tokens`` up to and including the first eos id (all of them when there is none)."""
    eos = set(eos_ids)
    for i, t in enumerate(tokens):
        if t in eos:
            return list(tokens[: i + 1])
    return list(tokens)


def first_divergence(ours: Sequence[int], ref: Sequence[int]) -> int | None:
    """Index of the first position where two continuations differ, or None when they are equal.

    Both should already be cut at eos (:func:`cut_at_eos`). When one is a strict prefix of the
    other (one side stopped, or hit ``max_tokens`` earlier), the divergence is at the shorter
    one's length: there, one side produced a token the other did not.
    """
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            return i
    return None if len(ours) == len(ref) else min(len(ours), len(ref))


def top2_margin(row_logprobs: Sequence[float]) -> float:
    """``top1 - top2`` of one row of log-probabilities (or logits), >= 0, in the row's units.

    Raises:
        ValueError: the row has fewer than two entries.
    """
    if len(row_logprobs) < 2:
        raise ValueError(f"a top-2 margin needs >= 2 values, got {len(row_logprobs)}")
    first = second = -math.inf
    for v in row_logprobs:
        if v > first:
            first, second = v, first
        elif v > second:
            second = v
    return first - second


def abs_deltas(ours: Sequence[float | None], ref: Sequence[float | None]) -> list[float]:
    """|ours[i] - ref[i]| at every position where both are known (a None is skipped: position 0
    of prompt log-probs, or a token one side did not score).

    Raises:
        ValueError: the sequences differ in length.
    """
    if len(ours) != len(ref):
        raise ValueError(f"log-prob lists differ in length: {len(ours)} vs {len(ref)}")
    return [abs(a - b) for a, b in zip(ours, ref) if a is not None and b is not None]


def perplexity(logprobs: Iterable[float | None]) -> float:
    """``exp(-mean logprob)`` over the known entries (nats in, a ratio out).

    Raises:
        ValueError: no known entry.
    """
    known = [lp for lp in logprobs if lp is not None]
    if not known:
        raise ValueError("perplexity of no tokens")
    return math.exp(-sum(known) / len(known))


@dataclass(frozen=True)
class Divergence:
    """Where one prompt's greedy continuation parted from HF's: token index in the continuation
    and HF float32's top-2 margin there (nats; None where HF has no row, e.g. past its eos)."""

    prompt_id: int
    index: int
    margin: float | None


@dataclass
class PathScore:
    """Everything a path's row shows; ``None`` marks a measure the path could not take.

    ``prompt_deltas``: |Δ logprob| of every scored prompt token, all prompts together (nats).
    ``gen_deltas``: the same for generated tokens over each prompt's shared prefix with HF.
    ``problems``: reasons the path did not test what it claims (e.g. no preemption happened);
    each one fails the verdict.
    """

    path: str
    dtype: str
    num_prompts: int
    num_equal: int
    divergences: list[Divergence] = field(default_factory=list)
    prompt_deltas: list[float] | None = None
    gen_deltas: list[float] | None = None
    ppl_ours: float | None = None
    ppl_ref: float | None = None
    evidence: dict[str, object] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def prompt_delta_mean(self) -> float | None:
        return _mean(self.prompt_deltas)

    @property
    def prompt_delta_max(self) -> float | None:
        return max(self.prompt_deltas) if self.prompt_deltas else None

    @property
    def gen_delta_mean(self) -> float | None:
        return _mean(self.gen_deltas)

    @property
    def gen_delta_max(self) -> float | None:
        return max(self.gen_deltas) if self.gen_deltas else None


def _mean(values: list[float] | None) -> float | None:
    return sum(values) / len(values) if values else None


def near_tie_bound(torch_mean: float | None) -> float:
    """The bfloat16 near-tie bound (nats): HF float32 top-2 margins below it may swap order in
    bfloat16 without a bug.

    Derived from the plain bf16 torch path of the same run (``torch_mean``: its mean |Δ logprob|
    against HF float32): model each token's log-prob error as a zero-mean normal, whose mean
    absolute value is ``σ·sqrt(2/π)``, so ``σ = torch_mean·sqrt(π/2)``; a top-2 gap is the
    difference of two such errors, ``σ_gap = sqrt(2)·σ = torch_mean·sqrt(π)``; the bound is
    :data:`NEAR_TIE_SIGMAS` of those, and never below :data:`NEAR_TIE`. On the default GGUF on
    an H200 (2026-12-04) the torch path's mean was 0.0493 nats (bound 0.262), and the torch path
    itself parted from HF float32 at margins up to 0.152: the random-weight bound of 0.06 fails
    the arithmetic HF bfloat16 does, so it cannot judge a fast path.
    """
    if torch_mean is None:
        return NEAR_TIE
    return max(NEAR_TIE, NEAR_TIE_SIGMAS * math.sqrt(math.pi) * torch_mean)


def judge(score: PathScore, torch_mean: float | None = None) -> tuple[bool, list[str]]:
    """Apply the rules to one path; returns (passed, reasons it failed or was limited).

    ``torch_mean``: the plain torch path's mean |Δ logprob| in the same dtype (the bfloat16
    rule's yardstick); None when it was not run, and then that rule is reported as not checked.
    A float32 path must equal HF greedily and keep mean |Δ| <= :data:`FLOAT32_MAX_MEAN_DELTA`;
    any other dtype may diverge only at margins below :func:`near_tie_bound` (``torch_mean``)
    and may not exceed ``torch_mean`` by more than :data:`MAX_REL_EXCESS_OVER_TORCH`.
    """
    reasons = list(score.problems)
    ok = not score.problems
    mean = score.prompt_delta_mean
    if score.dtype in FLOAT32_DTYPES:
        if score.divergences:
            ok = False
            reasons.append(f"{len(score.divergences)} greedy divergence(s) in float32")
        if mean is None:
            reasons.append("prompt logprobs n/a: |Δ| rule not checked")
        elif mean > FLOAT32_MAX_MEAN_DELTA:
            ok = False
            reasons.append(f"mean |Δ| {mean:.2e} > {FLOAT32_MAX_MEAN_DELTA:.0e}")
        return ok, reasons
    bound = near_tie_bound(torch_mean)
    wide = [d for d in score.divergences if d.margin is None or d.margin >= bound]
    if wide:
        ok = False
        where = ", ".join(f"p{d.prompt_id}@{d.index}" for d in wide[:5])
        reasons.append(f"{len(wide)} divergence(s) at margin >= {bound:.3f} ({where})")
    if torch_mean is None and score.divergences:
        reasons.append(f"torch path not run: near-tie bound {NEAR_TIE} (random-weight value)")
    if mean is None:
        reasons.append("prompt logprobs n/a: |Δ| rule not checked")
    elif torch_mean is None:
        reasons.append("torch path not run: relative |Δ| rule not checked")
    elif mean > torch_mean * (1 + MAX_REL_EXCESS_OVER_TORCH):
        ok = False
        reasons.append(f"mean |Δ| {mean:.2e} > torch path's {torch_mean:.2e} + 10%")
    return ok, reasons
