"""Per-request sampling slots: taken at the first sampled token, kept through preemption (seeded
generator state, penalty counts), given back when the request finishes."""

from __future__ import annotations

import pytest
import torch

from fastdeploy.core.request import Request
from fastdeploy.core.sampling_params import SamplingParams
from fastdeploy.worker.sampling_buffers import SamplingBuffers

V = 16
CPU = torch.device("cpu")


def request(rid: str, **params) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(**params), eos_token_ids=frozenset({0}))


def test_parameters_are_gathered_in_row_order_from_slots():
    buf = SamplingBuffers(4, CPU, seed=0)
    a = request("a", temperature=0.5, top_p=0.9, top_k=7)
    b = request("b", temperature=0)
    m = buf.prepare([a, b], V)
    assert m.temperature.tolist() == [0.5, 0.0] and m.top_k.tolist() == [7, 0]
    assert abs(m.top_p[0].item() - 0.9) < 1e-6 and m.processing is None
    m = buf.prepare([b, a], V)  # another order, same slots
    assert m.temperature.tolist() == [0.0, 0.5] and buf.num_used_slots == 2


def test_a_seeded_generator_lives_as_long_as_the_request():
    buf = SamplingBuffers(2, CPU, seed=0)
    a = request("a", temperature=1.0, seed=7)
    gen = buf.prepare([a], V).generators[0]
    torch.empty(V).exponential_(generator=gen)  # its first token's draw
    # Preempted (absent from steps), then resumed: the same generator, its state advanced, so
    # its next draw is the seed's second one, not its first again.
    assert buf.prepare([request("other")], V).generators == [None]
    again = buf.prepare([a], V).generators[0]
    assert again is gen
    fresh = torch.Generator().manual_seed(7)
    first_of_seed = torch.empty(V).exponential_(generator=fresh)
    second_of_seed = torch.empty(V).exponential_(generator=fresh)
    resumed = torch.empty(V).exponential_(generator=again)
    assert torch.equal(resumed, second_of_seed) and not torch.equal(resumed, first_of_seed)
    buf.free("a")
    assert buf.slot_of("a") is None and buf.num_used_slots == 1


def test_penalty_counts_and_masks_survive_until_free():
    buf = SamplingBuffers(2, CPU, seed=0)
    a = request("a", frequency_penalty=1.0, min_tokens=2, stop_token_ids=[5])
    m = buf.prepare([a], V)
    assert m.processing.stop_mask[0].nonzero().flatten().tolist() == [0, 5]  # eos + stop id
    assert m.processing.min_tokens_active.tolist() == [True]
    assert m.processing.prompt_mask[0].nonzero().flatten().tolist() == [1, 2, 3]
    buf.record([a], torch.tensor([9]))
    a.output_token_ids.append(9)
    buf.record([a], torch.tensor([9]))  # (a second step)
    a.output_token_ids.append(9)
    m = buf.prepare([a], V)
    assert m.processing.output_counts[0, 9].item() == 2
    assert m.processing.stop_mask is None  # 2 tokens out: min_tokens reached, no mask work
    slot = buf.slot_of("a")
    buf.free("a")
    b = request("b", presence_penalty=0.5)
    buf.prepare([b], V)
    assert buf.slot_of("b") == slot  # the slot is reused, its counts cleared
    assert buf.output_counts[slot].sum().item() == 0


def test_running_out_of_slots_is_an_error_and_reset_frees_all():
    buf = SamplingBuffers(2, CPU, seed=0)
    buf.prepare([request("a"), request("b")], V)
    with pytest.raises(RuntimeError, match="no sampling slot is free for request 'c'"):
        buf.prepare([request("c")], V)
    buf.reset()
    assert buf.num_used_slots == 0
    buf.prepare([request("c")], V)


def test_logit_bias_rows_are_written_and_cleared():
    buf = SamplingBuffers(2, CPU, seed=0)
    a = request("a", logit_bias={3: 5.0, 7: -100.0})
    b = request("b")
    m = buf.prepare([a, b], V)
    bias = torch.zeros(2, V).scatter_add(1, m.processing.bias_ids, m.processing.bias_values)
    assert bias[0, 3] == 5 and bias[0, 7] == -100 and bias[1].abs().sum() == 0


def test_greedy_rows_defer_their_slot_writes_until_a_step_gathers():
    buf = SamplingBuffers(3, CPU, seed=0)
    g = request("g", temperature=0, top_p=0.5, top_k=3)  # greedy: top-p/top-k unread
    m = buf.prepare([g], V)
    assert m.all_greedy and m.temperature is None and m.processing is None
    slot = buf.slot_of("g")
    assert buf.top_k[slot].item() == 0  # not written yet: nothing read it
    s = request("s", temperature=0.7, top_k=5)
    m = buf.prepare([s, g], V)  # a row that samples: every slot is written, then gathered
    assert m.top_k.tolist() == [5, 3] and m.temperature.tolist()[1] == 0.0
    assert abs(m.top_p[1].item() - 0.5) < 1e-6


def test_a_deferred_slot_given_back_is_written_for_its_next_request():
    buf = SamplingBuffers(2, CPU, seed=0)
    biased = request("b", temperature=0.5, logit_bias={4: 3.0})
    buf.prepare([biased], V)
    slot = buf.slot_of("b")
    buf.free("b")
    g = request("g", temperature=0, top_k=9)
    buf.prepare([g], V)  # takes the biased request's slot, written later
    assert buf.slot_of("g") == slot
    buf.free("g")  # given back before any write
    s = request("s", temperature=0.9, top_k=2)
    other = request("o", logit_bias={1: 1.0})
    m = buf.prepare([s, other], V)
    assert buf.slot_of("s") == slot and m.top_k.tolist() == [2, 0]
    bias = torch.zeros(2, V).scatter_add(1, m.processing.bias_ids, m.processing.bias_values)
    assert bias[0].abs().sum() == 0 and bias[1, 1] == 1  # the old bias row was cleared


def test_a_greedy_step_still_counts_its_tokens_in_its_own_slots():
    buf = SamplingBuffers(3, CPU, seed=0)
    p = request("p", temperature=0, frequency_penalty=1.0)
    buf.prepare([p], V)
    buf.record([p], torch.tensor([9]))
    g = request("g", temperature=0)
    buf.prepare([g], V)  # p is absent (preempted); g's row is the only one
    buf.record([g], torch.tensor([9]))
    assert buf.output_counts[buf.slot_of("p"), 9].item() == 1  # g's token is not p's
    assert buf.output_counts[buf.slot_of("g"), 9].item() == 1


def test_slots_taken_before_a_step_ran_out_are_still_written():
    buf = SamplingBuffers(2, CPU, seed=0)
    buf.prepare([request("x", temperature=0.9, top_k=7)], V)
    buf.free("x")
    s = request("s", temperature=0.5, top_k=2)
    with pytest.raises(RuntimeError, match="no sampling slot is free for request 'u'"):
        buf.prepare([s, request("t"), request("u")], V)  # s and t got slots, u none
    buf.free("t")
    m = buf.prepare([s], V)
    assert m.top_k.tolist() == [2] and m.temperature.tolist() == [0.5]  # not x's leftovers
