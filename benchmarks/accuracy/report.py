"""Score a path's run against the reference, and print the tables (one per path) and JSON."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from accuracy.metrics import (
    Divergence,
    PathScore,
    abs_deltas,
    cut_at_eos,
    first_divergence,
    judge,
    perplexity,
)
from accuracy.paths import PathSpec
from accuracy.reference import Reference
from accuracy.runner import PathRun


def score(
    spec: PathSpec,
    run: PathRun,
    ref: Reference,
    dtype: str,
    eos_ids: Sequence[int],
    prompt_ids: Sequence[int],
) -> PathScore:
    """Compare one run with HF float32, prompt by prompt (``prompt_ids``: the data-set ids).

    Greedy: both continuations cut at eos, first divergence and HF's margin there. Generated
    tokens' |Δ logprob| over each shared prefix; prompt tokens' |Δ logprob| and perplexity when
    the run has teacher-forced log-probs. An ``evidence`` counter of 0 is a problem (the path did
    not exercise its feature).
    """
    out = PathScore(spec.name, dtype, len(ref.prompts), 0, evidence=dict(run.evidence))
    gen, prompt = [], []
    for i, r in enumerate(ref.prompts):
        ours = cut_at_eos(run.greedy[i], eos_ids)
        at = first_divergence(ours, r.continuation)
        shared = len(ours) if at is None else at
        gen += abs_deltas(run.greedy_logprobs[i][:shared], r.continuation_logprobs[:shared])
        if at is None:
            out.num_equal += 1
        else:
            margin = r.margins[at] if at < len(r.margins) else None
            out.divergences.append(Divergence(prompt_ids[i], at, margin))
        if run.prompt_logprobs is not None:
            prompt += abs_deltas(run.prompt_logprobs[i], r.prompt_logprobs)
    out.gen_deltas = gen
    if run.prompt_logprobs is not None:
        out.prompt_deltas = prompt
    if run.text_logprobs is not None:
        out.ppl_ours = perplexity(run.text_logprobs)
        out.ppl_ref = perplexity(ref.text_logprobs)
    if spec.evidence and not run.evidence.get(spec.evidence):
        out.problems.append(f"not exercised: {spec.evidence} = {run.evidence.get(spec.evidence)}")
    return out


def _f(value: float | None, fmt: str = ".2e") -> str:
    return "n/a" if value is None or math.isnan(value) else format(value, fmt)


def header_lines(meta: dict[str, Any]) -> list[str]:
    """The lines naming device, dtype, model file and md5, commit and date."""
    return [
        f"device: {meta['device']}   dtype: {meta['dtype']}   reference: HF transformers "
        f"float32 on the same device",
        f"model: {meta['model']} (md5 {meta['md5']})",
        f"commit: {meta['commit']}   date: {meta['date']}   prompts: {meta['num_prompts']}   "
        f"max new tokens: {meta['max_new_tokens']}   perplexity text: {meta['text_tokens']} tokens",
    ] + ([f"greedy under JSON schema: {meta['json_schema']}"] if meta.get("json_schema") else [])


def path_table(spec: PathSpec, s: PathScore, ok: bool, reasons: list[str]) -> str:
    """One path's table: a row of the measures, then its divergences and evidence."""
    cols = [
        ("greedy equal", f"{s.num_equal}/{s.num_prompts}"),
        ("prompt |Δlp| mean", _f(s.prompt_delta_mean)),
        ("prompt |Δlp| max", _f(s.prompt_delta_max)),
        ("gen |Δlp| mean", _f(s.gen_delta_mean)),
        ("ppl ours", _f(s.ppl_ours, ".4f")),
        ("ppl HF", _f(s.ppl_ref, ".4f")),
        ("verdict", "PASS" if ok else "FAIL"),
    ]
    widths = [max(len(a), len(b)) for a, b in cols]
    lines = [f"== {spec.name}: {spec.description}"]
    lines.append("  ".join(a.ljust(w) for (a, _), w in zip(cols, widths)))
    lines.append("  ".join(b.ljust(w) for (_, b), w in zip(cols, widths)))
    for d in s.divergences:
        lines.append(
            f"   divergence: prompt {d.prompt_id} at token {d.index}, HF float32 top-2 margin "
            f"{_f(d.margin, '.4f')} nats"
        )
    lines.append(f"   evidence: {s.evidence}")
    lines += [f"   note: {r}" for r in reasons]
    return "\n".join(lines)


def skipped_table(spec: PathSpec, why: str) -> str:
    return f"== {spec.name}: {spec.description}\n   {why}"


def to_json(meta: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``--json`` document: the header fields and one object per path."""
    return {"meta": meta, "paths": rows}


def row_json(s: PathScore, ok: bool, reasons: list[str]) -> dict[str, Any]:
    d = asdict(s)
    d.pop("prompt_deltas"), d.pop("gen_deltas")
    d.update(
        prompt_delta_mean=s.prompt_delta_mean,
        prompt_delta_max=s.prompt_delta_max,
        gen_delta_mean=s.gen_delta_mean,
        gen_delta_max=s.gen_delta_max,
        passed=ok,
        notes=reasons,
    )
    return d


__all__ = ["score", "judge", "path_table", "skipped_table", "header_lines", "row_json", "to_json"]
