"""K/V stored with the RoPE (``ForwardMeta.kv_store``) against K/V stored by the attention: the
same logits and the same cache contents, step after step; and no store under a layer-by-layer
swap-in, whose copy must land before anything writes the cache."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from paged_runner import PagedRunner
from test_tiny_models import build_pair

from fastdeploy.model_executor.forward_meta import ForwardMeta


def run_steps(runner: PagedRunner, store_in_rope: bool) -> list[torch.Tensor]:
    """A prefill of two prompts (one padded row), then two decode steps; last-token logits."""
    steps = [
        ([("a", [5, 9, 17, 33, 2, 7]), ("b", [11, 3, 4])], 10),
        ([("a", [8]), ("b", [21])], None),
        ([("a", [13]), ("b", [1])], 4),
    ]
    out = []
    for chunks, pad in steps:
        batch, ids, pos = runner.build_batch(chunks, pad)
        meta = ForwardMeta(
            runner.backend,
            runner.backend.build_metadata(batch),
            runner.kv_caches,
            slot_mapping=batch.slot_mapping if store_in_rope else None,
        )
        with torch.inference_mode():
            hidden = runner.model(ids, pos, meta)[: batch.num_tokens]
            out.append(runner.model.compute_logits(hidden[batch.query_start_loc[1:].long() - 1]))
    return out


@pytest.mark.parametrize("name", ["qwen3", "llama3_bias"])
def test_kv_stored_with_rope_equals_kv_stored_by_attention(name):
    _, ours = build_pair(name)
    by_attention, by_rope = PagedRunner(ours), PagedRunner(ours)
    want = run_steps(by_attention, store_in_rope=False)
    got = run_steps(by_rope, store_in_rope=True)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-6)
    for w, g in zip(by_attention.kv_caches, by_rope.kv_caches):
        assert torch.equal(g, w)
    assert any(c.abs().sum() > 0 for c in by_rope.kv_caches)


def test_kv_store_is_off_without_slots_and_waits_under_layer_events():
    caches = [torch.zeros(1), torch.zeros(2)]
    slots = torch.tensor([0, -1])
    meta = ForwardMeta(None, None, caches, slot_mapping=slots)
    cache, got_slots = meta.kv_store(1)
    assert cache is caches[1] and got_slots is slots
    assert dataclasses.replace(meta, slot_mapping=None).kv_store(0) is None
    waited = []

    class Event:
        def __init__(self, i):
            self.i = i

        def wait(self):
            waited.append(self.i)

    under_swap_in = dataclasses.replace(meta, layer_events=[Event(0), Event(1)])
    assert under_swap_in.kv_store(1) == (caches[1], slots) and waited == [1]
