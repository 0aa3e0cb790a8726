"""Our engine's side: run one path through the offline API and collect what the measures need.

Greedy requests ask ``logprobs=0`` (the chosen token's log-prob); teacher-forced requests ask
``SamplingParams(prompt_logprobs=0, max_tokens=1)`` and read ``RequestOutput.prompt_logprobs``
(``None`` at position 0, then ``{"token_id", "logprob", ...}``). A PD path runs a prefill and a
decode ``LLMEngine`` in this process over the engine API (PD roles refuse ``prompt_logprobs``, so
its teacher-forced measures are n/a).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from accuracy.paths import PathSpec

#: A PD request that has not finished after this long is a hang, not slowness.
PD_TIMEOUT_S = 600.0


@dataclass
class PathRun:
    """What one path produced. ``greedy[i]``: generated tokens of prompt i (cut at nothing);
    ``greedy_logprobs[i][j]``: our log-prob of token j (None where the engine gave none);
    ``prompt_logprobs[i]`` / ``text_logprobs``: teacher-forced, None at 0 (None: not measured);
    ``evidence``: engine counters (preemptions, cached and host-hit tokens, steps by mode)."""

    greedy: list[list[int]]
    greedy_logprobs: list[list[float | None]]
    prompt_logprobs: list[list[float | None]] | None
    text_logprobs: list[float | None] | None
    evidence: dict[str, Any] = field(default_factory=dict)


@contextlib.contextmanager
def env_vars(values: dict[str, str]) -> Iterator[None]:
    """Set ``values`` in ``os.environ`` for the block, then restore what was there. The engine
    reads ``FD_*`` variables lazily, so the engine built and run inside sees them."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    _forget_cached_switches()
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        _forget_cached_switches()


def _forget_cached_switches() -> None:
    """The layers read ``FD_USE_FUSED_OPS``, ``FD_USE_SKINNY_GEMM`` and ``FD_SKINNY_GEMM_PDL``
    once per process (cached); every path builds its engine in this process, so the caches are
    cleared whenever the variables change, or the first path's answer would hold for all."""
    from fastdeploy.model_executor.layers import fused_ops, linear

    fused_ops.reset()
    linear.skinny_gemm_enabled.cache_clear()
    linear.skinny_pdl.cache_clear()


def _chosen_logprobs(entries: Sequence[dict] | None, n: int) -> list[float | None]:
    if entries is None:
        return [None] * n
    return [None if e is None else float(e["logprob"]) for e in entries][:n] + [None] * max(
        0, n - len(entries)
    )


def _prompt_lps(entries: Sequence[dict | None] | None) -> list[float | None] | None:
    if entries is None:
        return None
    return [None if e is None else float(e["logprob"]) for e in entries]


def run_path(
    spec: PathSpec,
    model: str | None,
    kwargs: dict[str, Any],
    prompts: Sequence[Sequence[int]],
    text_ids: Sequence[int],
    max_new_tokens: int,
    schema: dict[str, Any] | None = None,
) -> PathRun:
    """Build the path's engine (with its env vars), run greedy and teacher-forced requests,
    read its counters, shut it down. Raises whatever the engine raises.

    ``schema``: the greedy requests carry it as a ``json`` structured output (``--json-schema``);
    the teacher-forced ones never do."""
    with env_vars(spec.env):
        if spec.pd:
            return _run_pd(model, kwargs, prompts, max_new_tokens, schema)
        if spec.switching:
            from accuracy.switching import run_switching

            return run_switching(model, kwargs, prompts, text_ids, max_new_tokens, schema)
        from fastdeploy import LLM, SamplingParams

        llm = LLM(model, **kwargs)
        try:
            greedy = _greedy_params(max_new_tokens, schema)
            ids = [list(p) for p in prompts]
            outs = llm.generate(ids, greedy, use_tqdm=False)
            if spec.repeat:
                outs = llm.generate(ids, greedy, use_tqdm=False)
            scored = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
            tf = llm.generate(ids + [list(text_ids)], scored, use_tqdm=False)
            stats = llm.engine.get_stats()
        finally:
            llm.engine.shutdown()
    evidence = {
        "num_preemptions": stats["num_preemptions"],
        "num_cached_tokens": sum(o.num_cached_tokens for o in outs),
        "host_cache_hit_tokens": stats.get("host_cache_hit_tokens", 0),
        "steps_by_mode": stats["steps_by_mode"],
    }
    return PathRun(
        greedy=[list(o.outputs[0].token_ids) for o in outs],
        greedy_logprobs=[
            _chosen_logprobs(o.outputs[0].logprobs, len(o.outputs[0].token_ids)) for o in outs
        ],
        prompt_logprobs=[_prompt_lps(o.prompt_logprobs) for o in tf[:-1]],
        text_logprobs=_prompt_lps(tf[-1].prompt_logprobs),
        evidence=evidence,
    )


def _drive(engine: Any, requests: dict[str, tuple], timeout_s: float) -> dict[str, list]:
    """Add ``{rid: (ids, params, kv_params)}`` to an ``LLMEngine`` and step until all finished;
    returns each request's outputs in order. Raises ``TimeoutError`` past ``timeout_s``."""
    outs: dict[str, list] = {rid: [] for rid in requests}
    for rid, (ids, params, kv) in requests.items():
        engine.add_request(rid, list(ids), params, kv)
    left = set(requests)
    deadline = time.monotonic() + timeout_s
    while left:
        if time.monotonic() > deadline:
            raise TimeoutError(f"PD requests {sorted(left)[:5]} did not finish")
        for o in engine.step():
            if o.request_id in outs:
                if o.error is not None:
                    raise RuntimeError(f"request {o.request_id} failed: {o.error}")
                outs[o.request_id].append(o)
                if o.finished:
                    left.discard(o.request_id)
        if engine.last_step_idle:
            time.sleep(0.002)
    return outs


def greedy_from_steps(
    per_request: Sequence[Sequence[Any]],
) -> tuple[list[list[int]], list[list[float | None]]]:
    """Each request's generated tokens and their chosen log-probs, from its ``EngineOutput``
    list in step order (engine API paths: PD, ``capture-switch``)."""
    greedy, lps = [], []
    for outs in per_request:
        toks = [t for o in outs for t in o.new_token_ids]
        entries = [e for o in outs for e in (o.new_logprobs or [None] * len(o.new_token_ids))]
        greedy.append(toks)
        lps.append(_chosen_logprobs(entries, len(toks)))
    return greedy, lps


def _greedy_params(max_new_tokens: int, schema: dict[str, Any] | None) -> Any:
    """Greedy with the chosen token's log-prob, under ``schema`` when one is given."""
    from fastdeploy import SamplingParams
    from fastdeploy.core.structured_output import StructuredOutputsParams

    so = None if schema is None else StructuredOutputsParams(json=schema)
    return SamplingParams(
        temperature=0, max_tokens=max_new_tokens, logprobs=0, structured_outputs=so
    )


def _run_pd(model, kwargs, prompts, max_new_tokens, schema=None) -> PathRun:
    from fastdeploy.engine.args_utils import EngineArgs
    from fastdeploy.engine.engine import LLMEngine

    params = _greedy_params(max_new_tokens, schema)
    prefill = LLMEngine.from_engine_args(
        EngineArgs(model=model, splitwise_role="prefill", **kwargs)
    )
    decode = None
    try:
        decode = LLMEngine.from_engine_args(
            EngineArgs(model=model, splitwise_role="decode", **kwargs)
        )
        p_req = {
            f"p{i}": (ids, params, {"do_remote_decode": True}) for i, ids in enumerate(prompts)
        }
        p_outs = _drive(prefill, p_req, PD_TIMEOUT_S)
        d_req = {
            f"d{i}": (ids, params, p_outs[f"p{i}"][-1].kv_transfer_params)
            for i, ids in enumerate(prompts)
        }
        d_outs = _drive(decode, d_req, PD_TIMEOUT_S)
        deadline = time.monotonic() + 30
        while prefill.has_background_work() and time.monotonic() < deadline:
            prefill.step()  # the decode node's DONE frees the pending sends
            time.sleep(0.002)
        stats = decode.get_stats()
    finally:
        for e in (decode, prefill):
            if e is not None:
                e.shutdown()
    greedy, lps = greedy_from_steps([d_outs[f"d{i}"] for i in range(len(prompts))])
    evidence = {
        "kv_transfers": stats.get("pd", {}).get("transfers", 0),
        "steps_by_mode": stats["steps_by_mode"],
    }
    return PathRun(greedy, lps, None, None, evidence)
