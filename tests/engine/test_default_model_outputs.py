"""The issue's examples with the default model (SmolLM2-135M-Instruct GGUF) on CPU: a stop string
on the last step, stop strings and eos under min_tokens, the tokenizer's own token bytes, and a
seeded request through a forced preemption. Greedy outputs are those measured on CPU (float32)."""

from __future__ import annotations

import pytest
from support import record_preemptions

from fastdeploy import LLM, SamplingParams
from fastdeploy.core.detokenizer import TokenBytes

pytestmark = pytest.mark.slow

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
EOS, IM_START, PARIS = 2, 1, 7042  # <|im_end|>, <|im_start|>, " Paris"
ENGINE = dict(max_model_len=512, max_num_seqs=4, block_size=16)


@pytest.fixture(scope="module")
def llm():
    try:
        return LLM(num_gpu_blocks_override=200, **ENGINE)  # 3184 tokens: no preemption
    except FileNotFoundError as e:
        pytest.skip(str(e))


def chat(llm, **params):
    return llm.chat(FRANCE, SamplingParams(temperature=0, **params), use_tqdm=False)[0].outputs[0]


def test_a_stop_string_on_the_last_step_wins_over_length(llm):
    out = chat(llm, max_tokens=6, stop=["Paris"])
    assert out.token_ids[-1] == PARIS and len(out.token_ids) == 6
    assert out.text == "The capital of France is "
    assert (out.finish_reason, out.stop_reason) == ("stop", "Paris")


def test_stop_strings_do_not_end_a_request_before_min_tokens(llm):
    out = chat(llm, max_tokens=30, min_tokens=10, stop=["Paris"])
    assert len(out.token_ids) == 30 and out.finish_reason == "length"
    assert out.text.startswith("The capital of France is Paris.")  # token 6 matched no stop


def test_min_tokens_masks_eos_out_of_sampling(llm):
    plain = chat(llm, max_tokens=30)
    assert EOS in plain.token_ids[:20]  # greedy decoding ends after "Paris."
    out = chat(llm, max_tokens=30, min_tokens=20)
    assert EOS not in out.token_ids[:20] and IM_START not in out.token_ids
    assert "system" not in out.text and "user" not in out.text  # no invented turn
    assert out.text.startswith("The capital of France is Paris.") and len(out.token_ids) == 30


def test_token_bytes_come_from_the_vocabulary(llm):
    table = TokenBytes(llm.tokenizer)
    raw = [table.bytes_of(i) for i in range(len(table))]
    assert len(set(raw)) == len(raw) == 49152  # every token has its own bytes
    text = "Emoji list: 😀😃😄 — café, 東京, naïve\n\tend"
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(table.bytes_of(i) for i in ids) == text.encode("utf-8")
    assert table.token_str(PARIS) == " Paris" and table.token_str(EOS) == "<|im_end|>"
    partial = ids[5]  # the first token of an emoji: part of a UTF-8 character
    assert table.token_str(partial).startswith("bytes:\\x")


def test_a_seeded_request_through_a_forced_preemption_equals_a_roomy_pool(llm):
    """The issue's example: temperature 0.8, seed 103, block_size 16; preempted by a small pool,
    the request must go on with its own generator, not restart it from the seed."""
    tok = llm.tokenizer
    topics = ["a dragon", "the moon", "rainbows", "Paris"]
    ids = [
        tok.apply_chat_template(
            [{"role": "user", "content": f"Write a long story about {t}."}],
            add_generation_prompt=True,
            return_dict=False,
        )
        for t in topics
    ]
    params = [
        SamplingParams(temperature=0.8, seed=103 + i, max_tokens=80, ignore_eos=True)
        for i in range(len(ids))
    ]
    roomy = [o.outputs[0].token_ids for o in llm.generate(ids, params, use_tqdm=False)]
    small = LLM(num_gpu_blocks_override=20, skip_tokenizer_init=True, **ENGINE)
    try:
        preempted = record_preemptions(small.engine)
        got = [o.outputs[0].token_ids for o in small.generate(ids, params, use_tqdm=False)]
    finally:
        small.engine.shutdown()
    assert preempted, "the pool was large enough: no preemption happened"
    assert got == roomy
