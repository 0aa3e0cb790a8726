"""A layer-by-layer host-tier swap-in step on CPU: every layer waits on its own event once,
before its RoPE stores K/V (``ForwardMeta.kv_store``), so a host hit runs the same kernels as
any other prefill and gives the same hidden states. On an H200 the unfused path a host hit used
to run gave logits 0.30 apart from ``request`` mode and cost 58 s of flashinfer JIT on the
first hit."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import tiny_llama

from fastdeploy import LLM
from fastdeploy.worker.input_batch import dummy_step


class FakeEvent:
    """Stands in for a recorded ``torch.cuda.Event`` (CPU build): counts its waits and logs
    each one into the log the layers' K/V stores go to, so their order shows."""

    def __init__(self, log: list, layer: int) -> None:
        self.log, self.layer, self.waited = log, layer, 0

    def wait(self) -> None:
        self.waited += 1
        self.log.append(("wait", self.layer))


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_llama_layer_events")
    (d / "config.json").write_text(json.dumps(tiny_llama()))
    return LLM(str(d), load_format="dummy", skip_tokenizer_init=True, max_model_len=128,
               block_size=16, max_num_seqs=2, seed=0)  # fmt: skip


def run_prefill(runner, block_size: int, layer_events=None, log=None) -> tuple[torch.Tensor, list]:
    """Hidden states of one 16-token prefill, and ``log`` (a new list by default) with each
    layer's K/V store appended where ``ForwardMeta.kv_store`` returned."""
    log = [] if log is None else log
    kv_store = runner.build_forward_meta

    def spy(inputs, events=None):
        meta = kv_store(inputs, events)
        store = meta.kv_store

        def logged(layer_idx):
            got = store(layer_idx)
            log.append(("store", layer_idx, got is not None))
            return got

        meta.kv_store = logged
        return meta

    runner.build_forward_meta = spy
    try:
        hidden, _, mode = runner.forward(dummy_step([16], block_size), ("eager", None),
                                         layer_events)  # fmt: skip
    finally:
        del runner.build_forward_meta
    runner.reset_sampling_state()
    assert mode == "eager"
    return hidden.clone(), log


def test_layer_events_are_waited_before_the_fused_kv_store(llm):
    runner = llm.engine.worker.runner
    block_size = llm.engine.worker.config.cache_config.block_size
    layers = len(runner.kv_caches)
    plain, plain_log = run_prefill(runner, block_size)
    log: list = []
    events = [FakeEvent(log, i) for i in range(layers)]
    hidden, _ = run_prefill(runner, block_size, events, log)
    # Every layer stored K/V with its RoPE, as the plain prefill does, and waited once on its
    # own event before that store (nothing else waited in between).
    assert plain_log == [("store", i, True) for i in range(layers)]
    assert log == [step for i in range(layers) for step in (("wait", i), ("store", i, True))]
    assert [e.waited for e in events] == [1] * layers
    assert torch.equal(hidden, plain)


def test_attention_waits_when_it_stores_kv_itself(llm):
    # Without a slot mapping the attention stores K/V: then it makes the wait itself (once).
    runner = llm.engine.worker.runner
    block_size = llm.engine.worker.config.cache_config.block_size
    layers = len(runner.kv_caches)
    build = runner.build_forward_meta

    def no_slots(inputs, events=None):
        meta = build(inputs, events)
        meta.slot_mapping = None
        return meta

    log: list = []
    events = [FakeEvent(log, i) for i in range(layers)]
    runner.build_forward_meta = no_slots
    try:
        hidden, _, _ = runner.forward(dummy_step([16], block_size), ("eager", None), events)
    finally:
        del runner.build_forward_meta
    runner.reset_sampling_state()
    plain, _ = run_prefill(runner, block_size)
    assert [e.waited for e in events] == [1] * layers
    torch.testing.assert_close(hidden, plain, rtol=0, atol=1e-6)
