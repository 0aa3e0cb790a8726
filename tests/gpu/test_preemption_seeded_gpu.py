"""Seeded sampling through a forced preemption, CUDA graphs on: equal to a roomy pool.

A preempted request re-prefills its prompt and the tokens it had generated, then goes on with its
own generator (not restarted from the seed) and its penalty counts. In bf16 the recomputed KV may
differ from the decoded one by a rounding, so a sequence may leave the roomy pool's at a near-tie
of the seeded race; wherever that happens, both sequences must still be the seeded samples of the
reference model: at every step the token is the argmax of ``logits / T - log(q)`` (the
exponential race the sampler runs, ``q`` replayed from the seed) or within a bf16 near-tie of it.
A generator restarted at re-admission draws the wrong ``q`` and fails that check.

Run on a CUDA host: ``python -m pytest -q -m gpu tests/gpu/test_preemption_seeded_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch
from gpu_utils import NEAR_TIE, hf_reference, make_llm, preset_dir, random_prompts

from fastdeploy import SamplingParams

GRAPHS = {"use_cudagraph": True, "full_cuda_graph": False}
TEMPERATURE = 0.8
MAX_TOKENS = 96


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return preset_dir(tmp_path_factory, "smollm2-135m")


def generate(llm, prompts, params) -> tuple[list[list[int]], list[str]]:
    """Token ids of each prompt, and the ids of the requests preempted on the way."""
    preempted: list[str] = []
    original = llm.engine.scheduler.schedule

    def spy():
        out = original()
        preempted.extend(r.request_id for r in out.preempted)
        return out

    llm.engine.scheduler.schedule = spy
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.engine.scheduler.schedule = original
    return [o.outputs[0].token_ids for o in outs], preempted


@torch.inference_mode()
def assert_seeded_sample_of_hf(hf, prompt: list[int], tokens: list[int], seed: int) -> int:
    """Every token is the seeded exponential race's winner under HF's logits, or a bf16 near-tie
    of it. Returns the exact matches."""
    logits = hf(torch.tensor([prompt + tokens], device="cuda")).logits[0].float()
    logits = logits[len(prompt) - 1 : -1]
    gen = torch.Generator(device="cuda")
    gen.manual_seed(seed)
    exact = 0
    for t, tok in enumerate(tokens):
        q = torch.empty(logits.shape[-1], device="cuda").exponential_(generator=gen)
        score = logits[t] / TEMPERATURE - q.log()
        best = int(score.argmax())
        if best == tok:
            exact += 1
            continue
        gap = float(score[best] - score[tok])
        assert gap <= NEAR_TIE / TEMPERATURE, (
            f"step {t}: token {tok} vs the seeded race's winner {best}, score gap {gap:.4f}"
        )
    return exact


def test_seeded_requests_through_a_forced_preemption_with_graphs_equal_a_roomy_pool(model_dir):
    common = dict(graph_optimization_config=GRAPHS, block_size=16, max_num_seqs=8)
    roomy_llm = make_llm(model_dir, num_gpu_blocks_override=1024, **common)
    vocab = roomy_llm.engine.vocab_size
    prompts = random_prompts(6, vocab, 40, 80, seed=4)
    params = [
        SamplingParams(
            temperature=TEMPERATURE, seed=103 + i, max_tokens=MAX_TOKENS, ignore_eos=True
        )
        for i in range(len(prompts))
    ]
    try:
        roomy, none = generate(roomy_llm, prompts, params)
        assert not none
        graphs = roomy_llm.engine.get_stats()["steps_by_mode"]
        hf = hf_reference(roomy_llm, model_dir)
    finally:
        roomy_llm.engine.shutdown()
    # 6 requests of up to 176 tokens need ~66 blocks of 16; 32 blocks force preemptions.
    small_llm = make_llm(model_dir, num_gpu_blocks_override=32, **common)
    try:
        small, preempted = generate(small_llm, prompts, params)
        small_graphs = small_llm.engine.get_stats()["steps_by_mode"]
    finally:
        small_llm.engine.shutdown()
    assert preempted, "the small pool was large enough: no preemption happened"
    assert graphs["full"] > 0 and small_graphs["full"] > 0 and small_graphs["piecewise"] > 0
    assert all(len(t) == MAX_TOKENS for t in roomy + small)
    same = sum(a == b for a, b in zip(roomy, small))
    print(
        f"{same}/{len(prompts)} seeded sequences identical through {len(preempted)} "
        f"preemptions ({sorted(set(preempted))}); steps {small_graphs}"
    )
    for i, (p, a, b) in enumerate(zip(prompts, roomy, small)):
        exact_a = assert_seeded_sample_of_hf(hf, p, a, 103 + i)
        exact_b = assert_seeded_sample_of_hf(hf, p, b, 103 + i) if a != b else exact_a
        print(f"request {i}: {exact_a}/{len(a)} and {exact_b}/{len(b)} tokens equal HF's race")
    del hf
    torch.cuda.empty_cache()
