"""Serving while CUDA graphs are captured (issue #47), with real graphs on the GPU.

The engine is built (its ``LLM`` finishes the capture), then its graphs are dropped and a new
background capture starts on the same engine, through the same ``start_background_capture`` and
``capture_next_graph`` a server runs: batches run while buckets switch one by one, greedy tokens
equal the fully captured engine's, and a decode bucket whose capture raises (an injected out of
memory) stays eager while the others replay.

Run on a CUDA host: ``python -m pytest -q -m gpu tests/gpu/test_background_capture_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch
from gpu_utils import greedy, make_llm, preset_dir, random_prompts

from fastdeploy.model_executor.graph_optimization.capture_order import GapPacer

GRAPHS = {"use_cudagraph": True, "full_cuda_graph": False, "capture_in_background": True}


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    model_dir = preset_dir(tmp_path_factory, "smollm2-135m")
    llm = make_llm(model_dir, graph_optimization_config=GRAPHS, num_gpu_blocks_override=512)
    yield llm
    llm.engine.shutdown()


def test_batches_run_while_real_graphs_switch_in_and_a_failed_bucket_stays_eager(llm):
    engine = llm.engine
    worker, runner = engine.worker, engine.worker.runner
    plan = engine.graph_plan
    assert plan.capture_in_background
    stats = engine.get_stats()["graph_capture"]
    assert stats["done"] and stats["captured"] == stats["total"] and stats["failed"] == 0
    prompts = random_prompts(4, engine.vocab_size, 8, 40, seed=3)
    reference = greedy(llm, prompts, max_tokens=24)  # every bucket captured

    # Drop the graphs; capture again in the background, one graph per gap.
    runner.graph_runner.release()
    gcfg = engine.config.graph_opt_config
    graphs = runner.init_graph_runner(
        plan, gcfg.cudagraph_num_of_warmups, 0, capture_logits=worker.graphs_capture_logits
    )
    capture_full_decode = graphs.capture_full_decode

    def failing(batch_size, *args, **kwargs):
        if batch_size == 2:
            raise torch.OutOfMemoryError("injected: no memory for decode bucket 2")
        return capture_full_decode(batch_size, *args, **kwargs)

    graphs.capture_full_decode = failing
    worker.start_background_capture(graphs)
    progress = worker.capture_progress
    engine.capture_pacer = GapPacer(1.0)
    dispatch, steps = runner.dispatch, []

    def recording(sched):
        got = dispatch(sched)
        steps.append((got, {k: set(v) for k, v in progress.ready.items()}, progress.done))
        return got

    runner.dispatch = recording
    try:
        rounds = 0
        while not progress.done and rounds < 50:
            assert greedy(llm, prompts, max_tokens=24) == reference
            rounds += 1
        assert progress.done
        assert greedy(llm, prompts[:2], max_tokens=24) == reference[:2]  # decode bucket 2
    finally:
        del runner.dispatch
    serving = [s for s in steps if not s[2]]
    assert any(g[0] == "eager" for g, _, _ in serving)
    assert any(g[0] != "eager" for g, _, _ in serving)
    for (_, a, _), (_, b, _) in zip(steps, steps[1:]):
        assert all(a[k] <= b[k] for k in a)
    stats = engine.get_stats()["graph_capture"]
    assert stats["failed"] == 1 and stats["captured"] == stats["total"] - 1
    assert stats["failures"][0]["kind"] == "decode" and stats["failures"][0]["size"] == 2
    assert 2 not in graphs.full and graphs.full  # the others replay
    two = [g for g, _, _ in steps[-30:] if g == ("full", 2)]
    assert two == []  # bucket 2 never replays
