"""Logits processing (min_tokens mask, logit_bias, penalties) against element-by-element
references, and its place in the sampler (after the raw logprobs, before greedy and sampling)."""

from __future__ import annotations

import torch

from fastdeploy.model_executor.layers.logits_processor import (
    LogitsProcessingMetadata,
    apply_logit_bias,
    apply_min_tokens_mask,
    apply_penalties,
    process_logits,
)
from fastdeploy.model_executor.layers.sampler import Sampler, SamplingMetadata

V = 11


def reference_penalties(logits, prompts, outputs, rep, freq, pres):
    """vLLM's repetition penalty and OpenAI's frequency/presence penalties, one element at a
    time."""
    out = logits.clone()
    for i in range(logits.shape[0]):
        for t in range(V):
            x = float(out[i, t])
            count = outputs[i].count(t)
            if t in prompts[i] or count:
                x = x / rep[i] if x > 0 else x * rep[i]
            x -= freq[i] * count + pres[i] * (count > 0)
            out[i, t] = x
    return out


def test_penalties_match_the_reference():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, V, generator=g) * 3
    prompts = [[1, 2, 2], [], [5]]
    outputs = [[2, 3, 3, 3], [7, 7], []]
    rep, freq, pres = [1.5, 0.7, 1.0], [0.5, -1.0, 2.0], [0.25, 1.5, -2.0]
    prompt_mask = torch.zeros(3, V, dtype=torch.bool)
    counts = torch.zeros(3, V, dtype=torch.int32)
    for i in range(3):
        prompt_mask[i, prompts[i]] = True
        for t in outputs[i]:
            counts[i, t] += 1
    got = apply_penalties(
        logits, prompt_mask, counts, torch.tensor(rep), torch.tensor(freq), torch.tensor(pres)
    )
    torch.testing.assert_close(got, reference_penalties(logits, prompts, outputs, rep, freq, pres))
    # Hand-checked values: row 0, token 3 appeared 3 times: x -> x/1.5 - 0.5*3 - 0.25.
    x = float(logits[0, 3])
    expected = (x / 1.5 if x > 0 else x * 1.5) - 1.5 - 0.25
    assert abs(float(got[0, 3]) - expected) < 1e-6


def test_logit_bias_adds_at_its_ids_and_padding_adds_nothing():
    logits = torch.zeros(2, V)
    ids = torch.tensor([[4, 9, 0], [0, 0, 0]])
    values = torch.tensor([[100.0, -100.0, 0.0], [0.0, 0.0, 0.0]])
    got = apply_logit_bias(logits, ids, values)
    assert got[0, 4] == 100 and got[0, 9] == -100 and got[0].abs().sum() == 200
    assert got[1].abs().sum() == 0


def test_min_tokens_mask_applies_to_active_rows_only():
    logits = torch.zeros(2, V)
    stop_mask = torch.zeros(2, V, dtype=torch.bool)
    stop_mask[:, 2] = True
    got = apply_min_tokens_mask(logits, stop_mask, torch.tensor([True, False]))
    assert got[0, 2] == float("-inf") and got[1, 2] == 0
    assert torch.isfinite(got[0, [0, 1, 3]]).all()


def test_mask_wins_over_bias_and_input_is_not_modified():
    logits = torch.zeros(1, V)
    meta = LogitsProcessingMetadata(
        stop_mask=torch.eye(V, dtype=torch.bool)[2:3],
        min_tokens_active=torch.tensor([True]),
        bias_ids=torch.tensor([[2]]),
        bias_values=torch.tensor([[100.0]]),
    )
    got = process_logits(logits, meta)
    assert got[0, 2] == float("-inf") and logits.abs().sum() == 0


def meta(n: int, temperature: float = 0.0, processing=None, logprobs=None) -> SamplingMetadata:
    return SamplingMetadata(
        temperature=torch.full((n,), temperature),
        top_p=torch.ones(n),
        top_k=torch.zeros(n, dtype=torch.int64),
        generators=[None] * n,
        generator=torch.Generator().manual_seed(0),
        all_greedy=temperature == 0,
        max_num_logprobs=logprobs,
        processing=processing,
    )


def test_sampler_masks_greedy_rows_and_reports_raw_logprobs():
    logits = torch.tensor([[0.0, 1.0, 5.0, 2.0]])
    processing = LogitsProcessingMetadata(
        stop_mask=torch.tensor([[False, False, True, False]]),
        min_tokens_active=torch.tensor([True]),
    )
    out = Sampler()(logits, meta(1, processing=processing, logprobs=2))
    assert out.token_ids.tolist() == [3]  # 2 is masked: the next best
    raw = logits.log_softmax(-1)
    assert out.top_ids.tolist() == [[2, 3]]  # logprobs are those of the raw distribution
    torch.testing.assert_close(out.logprobs, raw[:, 3])


def test_sampler_random_rows_never_pick_a_masked_token():
    logits = torch.zeros(64, V)
    stop_mask = torch.zeros(64, V, dtype=torch.bool)
    stop_mask[:, :5] = True
    processing = LogitsProcessingMetadata(
        stop_mask=stop_mask, min_tokens_active=torch.ones(64, dtype=torch.bool)
    )
    out = Sampler()(logits, meta(64, temperature=1.0, processing=processing))
    assert (out.token_ids >= 5).all() and len(set(out.token_ids.tolist())) > 1


def test_sampler_takes_model_dtype_logits():
    """The LM head returns float32 logits, but the sampler still takes model-dtype ones: a
    greedy step without processing or logprobs takes their argmax as they are (ties to the
    first index), and a step that computes probabilities upcasts them first."""
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(8, 300, generator=g) * 4).to(torch.bfloat16)
    logits[3, 7] = logits[3, 250] = logits[3].max() + 1  # a tie
    greedy = Sampler()(logits, meta(8))
    assert greedy.token_ids.tolist() == logits.float().argmax(-1).tolist()
    assert greedy.token_ids[3] == 7
    with_logprobs = Sampler()(logits, meta(8, logprobs=1))
    assert with_logprobs.token_ids.tolist() == greedy.token_ids.tolist()
    assert with_logprobs.logprobs.dtype == torch.float32
    torch.testing.assert_close(
        with_logprobs.logprobs,
        logits.float().log_softmax(-1).gather(1, greedy.token_ids[:, None])[:, 0],
    )
    sampled = Sampler()(logits, meta(8, temperature=1.0))
    assert sampled.token_ids.dtype == torch.int64 and sampled.token_ids.shape == (8,)


def test_sampler_takes_a_given_argmax_only_where_the_logits_are_unprocessed():
    """A full decode graph hands the sampler its logits' argmax (``argmax=``). Greedy rows take
    it as it is when nothing processes the logits; a processed step (here a min_tokens mask)
    takes the argmax of the processed logits instead. The given argmax is deliberately not the
    true one, so each assertion tells which was used."""
    logits = torch.tensor([[0.0, 1.0, 5.0, 2.0], [3.0, 0.0, 0.0, 0.0]])
    given = torch.tensor([1, 2])  # not the argmax (2, 0): marks that the given one was taken
    out = Sampler()(logits, meta(2), argmax=given)
    assert out.token_ids is given
    assert Sampler()(logits, meta(2)).token_ids.tolist() == [2, 0]  # without it: computed
    # Logprobs asked: the slow path, the logits unprocessed: greedy rows keep the given argmax.
    assert Sampler()(logits, meta(2, logprobs=0), argmax=given).token_ids.tolist() == [1, 2]
    processing = LogitsProcessingMetadata(
        stop_mask=torch.tensor([[False, False, True, False]] * 2),
        min_tokens_active=torch.tensor([True, False]),
    )
    out = Sampler()(logits, meta(2, processing=processing), argmax=given)
    assert out.token_ids.tolist() == [3, 0]  # the masked row's next best; row 1 unmasked
