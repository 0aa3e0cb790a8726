"""``SamplingParams.n`` and the fan-out rule of ``n > 1`` (no model): the field's validation,
each choice's parameters (vLLM's ``seed + j``), and the engine refusing ``n != 1`` itself."""

from __future__ import annotations

import pytest

from fastdeploy.core.parallel_sampling import SEED_MODULUS, choice_params
from fastdeploy.core.request import check_sampling
from fastdeploy.core.sampling_params import SamplingParams


@pytest.mark.parametrize("bad", [0, -1, 1.5, "4", True, None])
def test_bad_n_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match=r"^n=.* is invalid; allowed: an integer >= 1"):
        SamplingParams(n=bad)


def test_n_is_accepted_and_kept():
    assert SamplingParams().n == 1
    assert SamplingParams(n=4, temperature=0).n == 4
    assert SamplingParams.from_dict({"n": 128}).n == 128


def test_choice_params_follow_vllms_seed_rule():
    params = SamplingParams(n=4, temperature=1.0, seed=7, prompt_logprobs=2, max_tokens=5)
    kids = [choice_params(params, j) for j in range(4)]
    assert [k.seed for k in kids] == [7, 8, 9, 10]
    assert all(k.n == 1 and k.max_tokens == 5 and k.temperature == 1.0 for k in kids)
    assert kids[0].prompt_logprobs == 2  # choice 0 carries the prompt's log-probabilities
    assert [k.prompt_logprobs for k in kids[1:]] == [None] * 3  # so siblings read the cache
    assert params.n == 4 and params.seed == 7  # the request's own params are left alone
    top = SamplingParams(n=3, seed=SEED_MODULUS - 1)
    assert [choice_params(top, j).seed for j in range(3)] == [SEED_MODULUS - 1, 0, 1]
    unseeded = SamplingParams(n=2)
    assert [choice_params(unseeded, j).seed for j in range(2)] == [None, None]
    one = SamplingParams(seed=3)
    assert choice_params(one, 0) is one  # n=1: unchanged (the server's only case for choice 0)
    assert choice_params(one, 2).seed == 5  # the server numbers choices on n=1 params
    for bad in (4, -1, 1.0):
        with pytest.raises(ValueError, match=r"choice j=.* is invalid; allowed: an integer in"):
            choice_params(params, bad)


def test_the_engine_takes_one_sequence_per_request():
    check_sampling(SamplingParams(n=1), vocab_size=100, has_tokenizer=True)
    with pytest.raises(ValueError, match=r"n=4 is invalid for one engine request; allowed: 1"):
        check_sampling(SamplingParams(n=4), vocab_size=100, has_tokenizer=True)
