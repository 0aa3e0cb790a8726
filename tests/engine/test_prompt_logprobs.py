"""``SamplingParams.prompt_logprobs`` through the engine on CPU (tiny random-weight Llama,
float32): the values equal log_softmax of a one-shot forward of the same model, whatever the
chunking, the overlap schedule, preemption by recompute or the prefix cache; each position is
emitted once; requests that did not ask pay nothing; refused modes name the field. The accuracy
against Hugging Face on the real model is in ``test_prompt_logprobs_hf.py``."""

from __future__ import annotations

import json

import pytest
import torch
from paged_runner import PagedRunner
from support import record_preemptions
from tiny_models import tiny_llama

from fastdeploy import LLM, SamplingParams
from fastdeploy.engine.admission import Admission

TINY = tiny_llama(num_hidden_layers=3)
ATOL = 1e-5  # float32; chunked attention sums in another order than one prefill


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_llama_plp")
    (d / "config.json").write_text(json.dumps(TINY))
    return str(d)


def tiny_llm(tiny_dir, **kw) -> LLM:
    args = dict(
        load_format="dummy", max_model_len=256, block_size=16, max_num_seqs=8, seed=0,
        skip_tokenizer_init=True,
    )  # fmt: skip
    args.update(kw)
    return LLM(tiny_dir, **args)


def prompts(n=4, lo=20, hi=90, seed=0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(3, 512, (k,), generator=g).tolist() for k in lens]


@pytest.fixture(scope="module")
def reference(tiny_dir):
    """request prompt -> float32 ``[P, V]`` log-probabilities of a one-shot forward of the
    engine's own model (teacher forcing: row ``i - 1`` scores prompt token ``i``)."""
    llm = tiny_llm(tiny_dir)

    def logprobs(ids: list[int]) -> torch.Tensor:
        _, logits = PagedRunner(llm.engine.worker.runner.model).step([("r", ids)])
        return logits.float().log_softmax(-1)

    yield logprobs
    llm.engine.shutdown()


def generate(llm, ps, k=3, **kw) -> list:
    params = SamplingParams(temperature=0, max_tokens=kw.pop("max_tokens", 4), prompt_logprobs=k,
                            ignore_eos=True, **kw)  # fmt: skip
    outs = llm.generate(ps, params, use_tqdm=False)
    llm.engine.check_integrity()
    stats = llm.engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    return outs


def check_against(ref_lp: torch.Tensor, ids: list[int], entries: list, k: int) -> None:
    """``entries`` are the prompt logprobs of ``ids``: None first, then each token's value, rank
    and top-k equal to ``ref_lp`` (``[P, V]``)."""
    assert len(entries) == len(ids) and entries[0] is None
    for i in range(1, len(ids)):
        e, row = entries[i], ref_lp[i - 1]
        assert e["token_id"] == ids[i]
        assert abs(e["logprob"] - row[ids[i]].item()) < ATOL, i
        x = row[ids[i]]  # rank: 1 + tokens more likely (those within ATOL may go either way)
        assert int((row > x + ATOL).sum()) + 1 <= e["rank"] <= int((row > x - ATOL).sum()) + 1
        top_lp, _ = row.topk(k)
        assert len(e["top_logprobs"]) == k
        got = torch.tensor([lp for _, lp in e["top_logprobs"]])
        assert torch.allclose(got, top_lp, atol=ATOL)
        for tid, lp in e["top_logprobs"]:
            assert abs(row[tid].item() - lp) < ATOL


@pytest.mark.parametrize(
    "kw",
    [
        {},  # one prefill step per prompt, overlap on (the default)
        {"max_num_batched_tokens": 16},  # chunked: 2-6 chunks per prompt, overlap on
        {"max_num_batched_tokens": 16, "disable_overlap_schedule": True},
        {"max_num_batched_tokens": 33, "disable_overlap_schedule": True},  # unaligned chunks
    ],
)
def test_prompt_logprobs_equal_a_one_shot_forward(tiny_dir, reference, kw):
    llm = tiny_llm(tiny_dir, **kw)
    ps = prompts()
    outs = generate(llm, ps, k=3)
    for ids, out in zip(ps, outs):
        check_against(reference(ids), ids, out.prompt_logprobs, 3)
    llm.engine.shutdown()


def test_chunk_boundaries_are_the_chunks(tiny_dir):
    """The rows a chunked prefill scores: each chunk its own positions, the last row of a chunk
    the next chunk's first token, the prompt's last row none (it samples)."""
    llm = tiny_llm(tiny_dir, max_num_batched_tokens=16, disable_overlap_schedule=True)
    engine = llm.engine
    ids = prompts(n=1, lo=40, hi=41)[0]
    seen = []
    original = engine.scheduler.schedule

    def schedule():
        out = original()
        seen.extend((s.num_computed_tokens, s.num_new_tokens, s.prompt_logprob_rows)
                    for s in out.scheduled)  # fmt: skip
        return out

    engine.scheduler.schedule = schedule
    generate(llm, [ids], k=0, max_tokens=2)
    assert seen[:3] == [(0, 16, range(0, 16)), (16, 16, range(16, 32)), (32, 8, range(32, 39))]
    assert seen[3][2] == range(39, 39)  # the decode scores no prompt token
    llm.engine.shutdown()


@pytest.mark.parametrize("overlap", [True, False])
def test_preemption_emits_each_position_once_and_the_same_values(tiny_dir, reference, overlap):
    ps = prompts(n=5, lo=40, hi=60, seed=8)
    small = tiny_llm(tiny_dir, num_gpu_blocks_override=14, max_num_batched_tokens=32,
                     disable_overlap_schedule=not overlap)  # fmt: skip
    preempted = record_preemptions(small.engine)
    rows = []
    runner = small.engine.worker.runner
    compute = runner.execute_model_async

    def spy(sched, *a, **k):  # every scored row, per request: none twice
        pending = compute(sched, *a, **k)
        if pending.prompt_logprobs is not None:
            plan = pending.prompt_logprobs.plan
            rows.extend(zip(plan.request_ids, plan.counts))
        return pending

    runner.execute_model_async = spy
    firsts: dict[str, int] = {}
    processor_outputs = []
    engine = small.engine
    params = SamplingParams(temperature=0, max_tokens=40, prompt_logprobs=2, ignore_eos=True)
    for i, ids in enumerate(ps):
        engine.add_request(f"r{i}", ids, params)
    while engine.has_unfinished_requests():
        for o in engine.step():
            processor_outputs.append(o)
            if o.prompt_logprobs is not None:
                firsts[o.request_id] = firsts.get(o.request_id, 0) + 1
                check_against(reference(ps[int(o.request_id[1:])]), ps[int(o.request_id[1:])],
                              o.prompt_logprobs, 2)  # fmt: skip
    assert preempted, "the pool was large enough: no preemption happened"
    assert firsts == {f"r{i}": 1 for i in range(len(ps))}
    scored: dict[str, int] = {}
    for rid, n in rows:
        scored[rid] = scored.get(rid, 0) + n
    assert scored == {f"r{i}": len(ids) - 1 for i, ids in enumerate(ps)}  # never twice
    engine.check_integrity()
    small.engine.shutdown()


def test_prefix_cache_is_not_read_but_written(tiny_dir, reference):
    llm = tiny_llm(tiny_dir)
    ids = prompts(n=1, lo=70, hi=71, seed=3)[0]
    plain = SamplingParams(temperature=0, max_tokens=2)
    first = llm.generate([ids], plain, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and first.prompt_logprobs is None
    again = llm.generate([ids], plain, use_tqdm=False)[0]
    assert again.num_cached_tokens == 64  # the cache works: 4 full blocks
    scored = generate(llm, [ids], k=1)[0]
    assert scored.num_cached_tokens == 0  # computed whole, not read from the cache
    check_against(reference(ids), ids, scored.prompt_logprobs, 1)
    # ...and its blocks are cached for others: a longer prompt over it hits them.
    after = llm.generate([ids + [5, 6]], plain, use_tqdm=False)[0]
    assert after.num_cached_tokens == 64
    llm.engine.shutdown()


def test_requests_that_do_not_ask_get_none_and_cost_nothing(tiny_dir):
    llm = tiny_llm(tiny_dir, max_num_batched_tokens=32)
    runner = llm.engine.worker.runner
    compute = runner.execute_model_async
    planned = []

    def spy(sched, *a, **k):
        pending = compute(sched, *a, **k)
        if pending.prompt_logprobs is not None:
            planned.append(pending.prompt_logprobs.plan)
        return pending

    runner.execute_model_async = spy
    ps = prompts(n=3)
    params = [
        SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=p) for p in (None, 0, None)
    ]
    outs = llm.generate(ps, params, use_tqdm=False)
    assert outs[0].prompt_logprobs is None and outs[2].prompt_logprobs is None
    assert len(outs[1].prompt_logprobs) == len(ps[1])
    assert all(e["top_logprobs"] == [] for e in outs[1].prompt_logprobs[1:])
    assert planned and all(p.request_ids == ["llm-1"] for p in planned)
    assert sum(sum(p.counts) for p in planned) == len(ps[1]) - 1
    llm.engine.shutdown()


@pytest.mark.parametrize("bad", [-1, 21, 2.0, True, "3"])
def test_bad_values_are_refused_naming_the_field(bad):
    with pytest.raises(ValueError, match=r"prompt_logprobs=.* is invalid; allowed: null or an "
                       r"integer in \[0, 20\]"):  # fmt: skip
        SamplingParams(prompt_logprobs=bad)


def test_pd_roles_and_tensor_parallelism_refuse_prompt_logprobs():
    params = SamplingParams(prompt_logprobs=1)
    for role in ("prefill", "decode"):
        with pytest.raises(ValueError, match=r"prompt_logprobs=1 is invalid: .*splitwise_role="):
            Admission(64, 100, False, splitwise_role=role).check([5, 6], params)
    with pytest.raises(ValueError, match="prompt_logprobs=1 is invalid: tensor_parallel_size=2"):
        Admission(64, 100, False, tensor_parallel_size=2).check([5, 6], params)
    Admission(64, 100, False).check([5, 6], params)  # mixed, one rank: fine
    Admission(64, 100, False, splitwise_role="prefill").check([5, 6], SamplingParams())
