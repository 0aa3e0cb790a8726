"""The engine on CPU with the tiny random-weight Llama of ``test_llm_engine`` (float32, exact):
min_tokens masks stop tokens, logit_bias and penalties act as defined, seeded sampling and
penalties survive preemption, and admission is bounded by the KV pool."""

from __future__ import annotations

import json
import logging

import pytest
from support import record_preemptions
from test_llm_engine import TINY, prompts, tiny_llm, tokens

from fastdeploy import SamplingParams
from fastdeploy.core.request import PromptTooLongError


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_llama_sampling")
    (d / "config.json").write_text(json.dumps(TINY))
    return str(d)


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return tiny_llm(tiny_dir)


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=kw.pop("max_tokens", 12), **kw)


# ----------------------------------------------------------------------- kind 2: masking
def test_min_tokens_masks_stop_token_ids(llm):
    p = prompts(n=1, seed=5)
    plain = tokens(llm, p, greedy(ignore_eos=True))[0]
    stop_id = plain[0]  # greedy decoding emits it first (and again and again)
    params = greedy(ignore_eos=True, stop_token_ids=[stop_id], min_tokens=6)
    out = llm.generate(p, params, use_tqdm=False)[0].outputs[0]
    assert stop_id not in out.token_ids[:6]
    assert len(out.token_ids) == 12 and out.finish_reason == "length"
    # The mask beats a +100 logit_bias while under min_tokens, and lifts right after: the 7th
    # token is the (biased) stop token, which ends the request.
    params = greedy(
        ignore_eos=True, stop_token_ids=[stop_id], min_tokens=6, logit_bias={stop_id: 100.0}
    )
    out = llm.generate(p, params, use_tqdm=False)[0].outputs[0]
    assert stop_id not in out.token_ids[:6] and out.token_ids[6:] == [stop_id]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)


def test_logit_bias_bans_and_forces_tokens(llm):
    p = prompts(n=1, seed=6)
    plain = tokens(llm, p, greedy(ignore_eos=True))[0]
    banned = tokens(llm, p, greedy(ignore_eos=True, logit_bias={plain[0]: -100.0}))[0]
    assert plain[0] not in banned and banned[0] != plain[0]
    forced = tokens(llm, p, greedy(ignore_eos=True, logit_bias={77: 100.0}))[0]
    assert forced == [77] * 12


def test_frequency_and_presence_penalties_follow_openai(llm):
    """Additive penalties shift a row's logits and logprobs alike, so the engine's greedy choice
    must be the argmax of the raw top-20 logprobs minus ``freq * count + pres * (count > 0)``."""
    p = prompts(n=1, seed=7)
    freq, pres = 1.5, 0.5
    params = greedy(
        ignore_eos=True, max_tokens=16, logprobs=20, frequency_penalty=freq, presence_penalty=pres
    )
    out = llm.generate(p, params, use_tqdm=False)[0].outputs[0]
    plain = tokens(llm, p, greedy(ignore_eos=True, max_tokens=16))[0]
    assert out.token_ids != plain
    for t, entry in enumerate(out.logprobs):
        seen = out.token_ids[:t]
        scores = {
            tid: lp - freq * seen.count(tid) - pres * (tid in seen)
            for tid, lp in entry["top_logprobs"]
        }
        assert out.token_ids[t] == max(scores, key=scores.get), f"step {t}"


def test_repetition_penalty_discourages_prompt_and_output_tokens(llm):
    p = [[7, 8, 9] * 10]
    plain = tokens(llm, p, greedy(ignore_eos=True, max_tokens=16))[0]
    out = tokens(llm, p, greedy(ignore_eos=True, max_tokens=16, repetition_penalty=100.0))[0]
    # With a huge penalty every token of the prompt or the output so far loses to any unseen one
    # whose logit is positive: no token repeats and none comes from the prompt.
    assert len(set(out)) == len(out) and not set(out) & {7, 8, 9}
    assert out != plain


# --------------------------------------------------------------- kind 4: preemption state
def test_seeded_sampling_with_penalties_through_preemption_equals_a_roomy_pool(llm, tiny_dir):
    ps = prompts(n=5, lo=40, hi=60, seed=8)
    params = [
        SamplingParams(
            temperature=0.9,
            top_k=50,
            seed=100 + i,
            max_tokens=40,
            ignore_eos=True,
            frequency_penalty=0.4,
            repetition_penalty=1.2,
        )
        for i in range(len(ps))
    ]
    roomy = [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)]
    small = tiny_llm(tiny_dir, num_gpu_blocks_override=14)  # 13 usable blocks of 16 tokens
    preempted = record_preemptions(small.engine)
    got = [o.outputs[0].token_ids for o in small.generate(ps, params, use_tqdm=False)]
    assert preempted, "the pool was large enough: no preemption happened"
    assert got == roomy
    assert small.engine.worker.runner.sampling.num_used_slots <= 8


# ------------------------------------------------------------- kind 5: the KV pool bound
def test_max_model_len_is_lowered_to_the_pool_and_named_in_refusals(tiny_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="fastdeploy"):
        small = tiny_llm(tiny_dir, num_gpu_blocks_override=6)  # 5 usable blocks = 80 tokens
    engine = small.engine
    assert engine.max_model_len == 80
    assert "max_model_len lowered from 256 to 80" in caplog.text
    with pytest.raises(PromptTooLongError) as err:
        small.generate([[5] * 121], greedy(), use_tqdm=False)
    message = str(err.value)
    assert "121 tokens" in message and "max_model_len is 80" in message
    assert "5 blocks of 16 tokens" in message
    assert not engine.has_unfinished_requests()
    out = small.generate([[5] * 79], greedy(), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 1


def test_a_request_that_outgrows_the_whole_pool_ends_with_length_not_abort(tiny_dir):
    small = tiny_llm(tiny_dir, num_gpu_blocks_override=6)  # 80 tokens
    out = small.generate(
        [[5] * 60], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 20


def test_requests_that_outgrow_the_free_blocks_are_preempted_and_all_finish(llm, tiny_dir):
    ps = prompts(n=4, lo=50, hi=70, seed=9)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    roomy = llm.generate(ps, params, use_tqdm=False)
    small = tiny_llm(tiny_dir, num_gpu_blocks_override=10)  # 144 tokens: one request at a time
    outs = small.generate(ps, params, use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outs] == ["length"] * 4
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in roomy]
    stats = small.engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_a_kv_budget_below_one_max_model_len_lowers_it_instead_of_failing(tiny_dir, monkeypatch):
    """FD_CPU_KV_CACHE_SPACE too small for max_model_len=256: the engine starts and lowers it."""
    from fastdeploy.engine.engine import LLMEngine

    monkeypatch.setenv("FD_CPU_KV_CACHE_SPACE", "0.00009")  # ~94 KiB: 7 blocks of 16 tokens
    small = tiny_llm(tiny_dir)
    try:
        engine: LLMEngine = small.engine
        assert engine.max_model_len < 256
        assert engine.max_model_len == (engine.worker.num_blocks - 1) * 16
        assert "lowered from 256" in engine.max_model_len_note
        out = small.generate([[5, 6, 7]], greedy(max_tokens=4), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
    finally:
        small.engine.shutdown()


def test_preemptions_are_counted_in_the_stats_and_the_metrics(tiny_dir):
    """A pool that holds one request at a time preempts: ``get_stats()['num_preemptions']``
    counts every preempted request, and ``/metrics`` (``ServerMetrics.render``) shows it as
    ``fastdeploy:num_preemptions_total``, once however often the same stats are observed."""
    from prometheus_client.parser import text_string_to_metric_families

    from fastdeploy.metrics import ServerMetrics

    small = tiny_llm(tiny_dir, num_gpu_blocks_override=10)  # 144 tokens
    try:
        preempted = record_preemptions(small.engine)
        metrics = ServerMetrics()
        assert small.engine.get_stats()["num_preemptions"] == 0
        params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
        small.generate(prompts(n=4, lo=50, hi=70, seed=9), params, use_tqdm=False)
        stats = small.engine.get_stats()
        assert preempted, "the pool was large enough: no preemption happened"
        assert stats["num_preemptions"] == len(preempted)
        metrics.observe_stats(stats)
        metrics.observe_stats(stats)
        text = metrics.render().decode()
        samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
        assert samples["fastdeploy:num_preemptions_total"] == len(preempted)
    finally:
        small.engine.shutdown()
