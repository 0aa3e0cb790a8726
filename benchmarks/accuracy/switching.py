"""The ``capture-switch`` path (issue #47, "correct while switching"): greedy requests in flight
while the engine captures its CUDA graphs in the background, so the same requests run some
steps eagerly and later ones from graphs captured meanwhile.

The engine is an ``LLMEngine`` driven step by step (the offline ``LLM`` finishes capture in its
constructor): its capture pacer captures one graph before every step (``GapPacer(1.0)``), and the
greedy requests enter one per step, so the decode batch grows through the small buckets while
they switch. The teacher-forced requests (``prompt_logprobs``) follow on the same engine, still
capturing. ``evidence["graph_switches"]`` counts the graphs captured while a greedy request was
in flight; 0 means the path tested nothing (the harness then fails it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from accuracy.runner import PathRun, _greedy_params, _prompt_lps, greedy_from_steps

#: A request that has not finished after this many steps is a hang.
MAX_STEPS = 100_000


def run_switching(
    model: str | None,
    kwargs: dict[str, Any],
    prompts: Sequence[Sequence[int]],
    text_ids: Sequence[int],
    max_new_tokens: int,
    schema: dict[str, Any] | None = None,
) -> PathRun:
    """Run the greedy and the teacher-forced requests through one engine whose graphs are
    captured between its steps (module docstring).

    Raises:
        RuntimeError: the engine has no background capture to run (graphs off, or
            ``capture_in_background`` false), a request failed, or one never finished.
    """
    from fastdeploy import SamplingParams
    from fastdeploy.engine.args_utils import EngineArgs
    from fastdeploy.engine.engine import LLMEngine
    from fastdeploy.model_executor.graph_optimization.capture_order import GapPacer

    engine = LLMEngine.from_engine_args(EngineArgs(model=model, **kwargs))
    try:
        if not engine.graph_capture_pending():
            raise RuntimeError(
                "capture-switch needs a background capture: graphs on (CUDA) and "
                "capture_in_background true"
            )
        engine.capture_pacer = GapPacer(1.0)  # one graph before every step
        greedy = _greedy_params(max_new_tokens, schema)
        queue = [(f"g{i}", list(p), greedy) for i, p in enumerate(prompts)]
        outs, switches = _drive_staggered(engine, queue)
        scored = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
        tf_queue = [(f"t{i}", list(p), scored) for i, p in enumerate([*prompts, text_ids])]
        tf, _ = _drive_staggered(engine, tf_queue)
        stats = engine.get_stats()
    finally:
        engine.shutdown()
    greedy_ids, greedy_lps = greedy_from_steps([outs[f"g{i}"] for i in range(len(prompts))])
    prompt_lps = [_prompt_lps(tf[f"t{i}"][0].prompt_logprobs) for i in range(len(prompts) + 1)]
    capture = stats.get("graph_capture") or {}
    evidence = {
        "graph_switches": switches,
        "steps_by_mode": stats["steps_by_mode"],
        "graphs_captured": f"{capture.get('captured')}/{capture.get('total')}",
    }
    return PathRun(greedy_ids, greedy_lps, prompt_lps[:-1], prompt_lps[-1], evidence)


def _drive_staggered(engine: Any, queue: list[tuple[str, list[int], Any]]) -> tuple[dict, int]:
    """Add the requests of ``queue`` one per step and step until all finished. Returns each
    request's outputs in order and how many graphs were captured while one was in flight."""
    outs: dict[str, list] = {rid: [] for rid, _, _ in queue}
    left = set(outs)
    waiting = list(queue)
    switches = 0
    for _ in range(MAX_STEPS):
        if not left:
            return outs, switches
        if waiting:
            rid, ids, params = waiting.pop(0)
            engine.add_request(rid, ids, params)
        before = _captured(engine)
        for o in engine.step():
            if o.request_id in outs:
                if o.error is not None:
                    raise RuntimeError(f"request {o.request_id} failed: {o.error}")
                outs[o.request_id].append(o)
                if o.finished:
                    left.discard(o.request_id)
        switches += _captured(engine) - before
    raise RuntimeError(f"requests {sorted(left)[:5]} did not finish in {MAX_STEPS} steps")


def _captured(engine: Any) -> int:
    return (engine.get_stats().get("graph_capture") or {}).get("captured", 0)
