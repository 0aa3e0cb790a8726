"""The worker's kernel warm-up before capture, on CPU: with ``swap_in_mode=layerwise`` it also runs
a prefill the way a host hit runs it (per-layer events, RoPE and the KV write apart), so the
first host hit builds no kernel (on an H200 it spent 58 s in flashinfer's JIT before this)."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import tiny_llama

from fastdeploy import LLM
from fastdeploy.worker.input_batch import dummy_step


class FakeEvent:
    """Stands in for ``torch.cuda.Event`` (CPU build): records what the warm-up does with it."""

    made: list[FakeEvent] = []

    def __init__(self) -> None:
        self.recorded = self.waited = 0
        FakeEvent.made.append(self)

    def record(self) -> None:
        self.recorded += 1

    def wait(self) -> None:
        self.waited += 1


def spy_kv_stores(runner, monkeypatch) -> list:
    """Record, per step the runner builds, what the first layer gets from
    ``ForwardMeta.kv_store`` (None: the layers do not store K/V with their RoPE)."""
    kv_stores = []
    forward_meta = runner.build_forward_meta

    def spy(inputs, layer_events=None):
        meta = forward_meta(inputs, layer_events)
        kv_stores.append(meta.kv_store(0))
        return meta

    monkeypatch.setattr(runner, "build_forward_meta", spy)
    return kv_stores


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_llama_warm_up")
    (d / "config.json").write_text(json.dumps(tiny_llama()))
    return LLM(str(d), load_format="dummy", skip_tokenizer_init=True, max_model_len=128,
               block_size=16, max_num_seqs=2, seed=0)  # fmt: skip


@pytest.mark.parametrize(("swap_space", "mode", "steps"), [
    (4, "layerwise", 1), (4, "request", 0), (0, "layerwise", 0),
])  # fmt: skip
def test_layerwise_host_tier_warms_up_the_host_hit_path(llm, monkeypatch, swap_space, mode, steps):
    worker = llm.engine.worker
    cache = worker.config.cache_config
    monkeypatch.setattr(cache, "swap_space", swap_space)
    monkeypatch.setattr(cache, "swap_in_mode", mode)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    FakeEvent.made.clear()
    kv_stores = spy_kv_stores(worker.runner, monkeypatch)
    before = dict(worker.runner.steps_by_mode)
    assert worker._warm_up_layerwise_swap_in(16, cache.block_size) == steps
    assert worker.runner.steps_by_mode["eager"] - before["eager"] == steps
    layers = len(worker.runner.kv_caches)
    if steps:
        # Every layer's attention waited on its own (already recorded) event, and the layers did
        # not store K/V with their RoPE: the kernels of a host hit ran.
        assert len(FakeEvent.made) == layers
        assert all(e.recorded == 1 and e.waited == 1 for e in FakeEvent.made)
        assert kv_stores == [None]
    else:
        assert FakeEvent.made == [] and kv_stores == []
    worker.runner.reset_sampling_state()


def test_without_events_the_layers_store_kv_with_their_rope(llm, monkeypatch):
    # The contrast that makes the check above meaningful: a plain prefill fuses the KV store.
    runner = llm.engine.worker.runner
    kv_stores = spy_kv_stores(runner, monkeypatch)
    runner.execute_model(dummy_step([16], llm.engine.worker.config.cache_config.block_size))
    runner.reset_sampling_state()
    assert len(kv_stores) == 1 and kv_stores[0] is not None
