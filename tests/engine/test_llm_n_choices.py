"""``LLM.generate`` with ``SamplingParams(n=4)`` on the default model (SmolLM2-135M-Instruct
GGUF, CPU; prefix caching on, 16-token blocks): one ``RequestOutput`` per prompt with outputs
``index`` 0..3 (vLLM's shape and order), the prompt prefilled once (the engine's prefix-cache
counters: 4 x 100 tokens looked up, 3 x 96 found), greedy choices identical, seeded choices
reproducible and mostly distinct, choice ``j`` equal to ``n=1`` with ``seed + j``."""

from __future__ import annotations

import pytest

from fastdeploy import LLM, SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm():
    try:
        llm = LLM(num_gpu_blocks_override=200, max_model_len=512, max_num_seqs=8, block_size=16)
    except FileNotFoundError as e:
        pytest.skip(str(e))
    yield llm
    llm.engine.shutdown()


def prompt(start: int) -> list[int]:
    """100 token ids of this test's own (6 whole 16-token blocks and 4 tokens): nothing of it is
    in the prefix cache before."""
    return [start + 3 * i for i in range(100)]


def counters(llm) -> tuple[int, int]:
    stats = llm.engine.get_stats()
    return stats["prefix_cache_queries"], stats["prefix_cache_hits"]


def test_greedy_n4_prefills_once_and_answers_four_equal_outputs(llm):
    ids = prompt(5000)
    alone = llm.generate([ids], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    ids = prompt(7000)
    queries0, hits0 = counters(llm)
    [out] = llm.generate(
        [ids], SamplingParams(n=4, temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False
    )
    queries, hits = counters(llm)
    print(f"n=4, 100-token prompt: prefix-cache queries +{queries - queries0}, "
          f"hits +{hits - hits0} tokens")  # fmt: skip
    assert queries - queries0 == 4 * 100  # four engine requests looked the prompt up
    assert hits - hits0 == 3 * 96  # three found its 6 whole blocks: one prefill
    assert out.finished and out.prompt_token_ids == ids and out.request_id.startswith("llm-")
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 8 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) == 1
    assert len({c.text for c in out.outputs}) == 1
    assert out.num_cached_tokens == 0  # choice 0 prefilled it
    assert alone.outputs[0].index == 0 and len(alone.outputs) == 1  # n=1 as before


def test_seeded_n4_is_reproducible_distinct_and_follows_seed_plus_j(llm):
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
    first = llm.generate([prompt(9000)], params, use_tqdm=False)[0]
    again = llm.generate([prompt(9000)], params, use_tqdm=False)[0]
    tokens = [tuple(c.token_ids) for c in first.outputs]
    assert tokens == [tuple(c.token_ids) for c in again.outputs]
    assert len(set(tokens)) >= 3, tokens  # mostly distinct
    for j in range(4):
        alone = SamplingParams(temperature=1.0, seed=11 + j, max_tokens=12, ignore_eos=True)
        [out] = llm.generate([prompt(9000)], alone, use_tqdm=False)
        assert tuple(out.outputs[0].token_ids) == tokens[j], j


def test_several_prompts_keep_their_order_and_indices(llm):
    prompts = ["The capital of France is", "One, two, three,"]
    outs = llm.generate(
        prompts, SamplingParams(n=3, temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False
    )
    assert [o.prompt for o in outs] == prompts
    for o in outs:
        assert [c.index for c in o.outputs] == [0, 1, 2]
        assert len({c.text for c in o.outputs}) == 1
    alone = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                         use_tqdm=False)  # fmt: skip
    assert [o.outputs[0].text for o in outs] == [a.outputs[0].text for a in alone]
    mixed = llm.generate(
        prompts,
        [SamplingParams(n=2, temperature=0, max_tokens=4), SamplingParams(max_tokens=4)],
        use_tqdm=False,
    )
    assert [len(o.outputs) for o in mixed] == [2, 1]


def test_a_bad_n_queues_nothing(llm):
    with pytest.raises(ValueError, match=r"^n=0 is invalid; allowed: an integer >= 1"):
        llm.generate(["hi"], SamplingParams(n=0))
    params = SamplingParams(n=2, stop_token_ids=[10**6])  # out of the vocabulary
    with pytest.raises(ValueError, match="stop_token_ids=1000000 is invalid"):
        llm.generate(["hi"], params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.get_stats()["num_running"] == 0
