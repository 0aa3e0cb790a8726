"""What the engine reads from its worker goes through the worker's public face: the KV cache
(``GpuWorker.kv_caches``) and the step counters (``GpuWorker.get_stats``), which count served
steps only (the warm-up's steps are not counted)."""

from __future__ import annotations

import json

import pytest
from tiny_models import tiny_llama

from fastdeploy import LLM, SamplingParams
from fastdeploy.worker.gpu_worker import GpuWorker


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_llama_worker_api")
    (d / "config.json").write_text(json.dumps(tiny_llama()))
    return LLM(str(d), load_format="dummy", skip_tokenizer_init=True, max_model_len=128,
               block_size=16, max_num_seqs=2, seed=0)  # fmt: skip


def test_counters_start_at_zero_and_count_served_steps(llm):
    worker = llm.engine.worker
    assert isinstance(worker, GpuWorker)
    before = worker.get_stats()
    engine_stats = llm.engine.get_stats()  # the engine reports the worker's counts
    assert {key: engine_stats[key] for key in before} == before
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    llm.generate([[1, 2, 3, 4]], params, use_tqdm=False)
    after = worker.get_stats()
    assert sum(after["steps_by_mode"].values()) - sum(before["steps_by_mode"].values()) >= 3
    assert before["steps_by_mode"] is not worker.get_stats()["steps_by_mode"]  # a copy


def test_a_fresh_engine_reports_no_steps(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny_llama()))
    fresh = LLM(str(tmp_path), load_format="dummy", skip_tokenizer_init=True, max_model_len=64,
                block_size=16, max_num_seqs=2, seed=0)  # fmt: skip
    try:
        stats = fresh.engine.worker.get_stats()
        assert stats == {"steps_by_mode": {"full": 0, "piecewise": 0, "eager": 0},
                         "num_padded_tokens": 0}  # fmt: skip
    finally:
        fresh.engine.shutdown()


def test_kv_caches_are_the_runners_list(llm):
    worker = llm.engine.worker
    caches = worker.kv_caches
    assert caches is worker.runner.kv_caches
    assert len(caches) == worker.num_layers
    assert caches[0].shape[0] == worker.num_blocks
