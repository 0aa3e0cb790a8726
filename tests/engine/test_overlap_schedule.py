"""The overlap schedule end to end on CPU (tiny random-weight Llama with a word-level tokenizer,
float32): the host schedules step N+1 before it reads step N's tokens, which the device feeds
forward. Tokens (greedy and seeded), stop strings, stop tokens, eos under ``min_tokens``,
``max_tokens``, aborts mid-generation and preemption by a small KV pool all give what the
serial step loop gives; no token is emitted after a request finished, and no block leaks."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from support import record_preemptions
from tiny_models import tiny_llama

from fastdeploy import LLM, SamplingParams
from fastdeploy.config import SchedulerConfig
from fastdeploy.engine.args_utils import EngineArgs

TINY = tiny_llama(num_hidden_layers=3)
EOS = 2


def write_tokenizer(directory, vocab_size: int) -> None:
    """A word-level tokenizer: id ``i >= 3`` is the word ``w{i}``; 0-2 are specials, 2 is eos."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials)}
    vocab.update({f"w{i}": i for i in range(len(specials), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>", bos_token="<|im_start|>"
    )
    fast.save_pretrained(directory)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_llama_tok")
    (d / "config.json").write_text(json.dumps(TINY))
    write_tokenizer(d, TINY["vocab_size"])
    return str(d)


def tiny_llm(tiny_dir, **kw) -> LLM:
    args = dict(load_format="dummy", max_model_len=256, block_size=16, max_num_seqs=8, seed=0)
    args.update(kw)
    return LLM(tiny_dir, **args)


@pytest.fixture(scope="module")
def on(tiny_dir):
    llm = tiny_llm(tiny_dir, max_num_batched_tokens=48)  # chunks mixed with decodes
    assert llm.engine.overlap_schedule  # the default, CPU included
    return llm


@pytest.fixture(scope="module")
def off(tiny_dir):
    llm = tiny_llm(tiny_dir, max_num_batched_tokens=48, disable_overlap_schedule=True)
    assert not llm.engine.overlap_schedule
    return llm


def prompts(n=6, lo=3, hi=90, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(3, 512, (k,), generator=g).tolist() for k in lens]


def run(llm, ps, params) -> list[tuple]:
    """Each request's (token ids, text, finish reason, stop reason, logprobs), by driving
    ``step()``; checks that every request emits exactly its tokens, finishes once, last, and that
    the pool is whole afterwards. Also returns how many token rows the device fed forward."""
    engine = llm.engine
    fed = []
    prepare = engine.worker.runner.buffers.prepare

    def spy(*args, **kwargs):
        inputs = prepare(*args, **kwargs)
        fed.append(inputs.num_fed)
        return inputs

    engine.worker.runner.buffers.prepare = spy
    try:
        outs = llm.generate(ps, params, use_tqdm=False)
    finally:
        engine.worker.runner.buffers.prepare = prepare
    engine.check_integrity()
    stats = engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    result = [
        (c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs)
        for c in (o.outputs[0] for o in outs)
    ]
    return result, sum(fed)


def test_greedy_seeded_and_logprob_tokens_equal_with_overlap_on_and_off(on, off):
    ps = prompts()
    params = [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0.8, seed=11, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=40, top_p=0.9, seed=12, max_tokens=17,
                       ignore_eos=True, frequency_penalty=0.5, repetition_penalty=1.2),
        SamplingParams(temperature=0.7, seed=13, max_tokens=21, ignore_eos=True,
                       presence_penalty=0.6, logprobs=2, logit_bias={7: 3.0}),
        SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=14, max_tokens=26, ignore_eos=True, min_tokens=20),
    ]  # fmt: skip
    got, fed = run(on, ps, params)
    want, fed_off = run(off, ps, params)
    assert got == want
    assert fed > 0 and fed_off == 0  # placeholders were fed on the device, only with overlap
    assert [len(t[0]) for t in got] == [24, 30, 17, 21, 9, 26]


def test_stop_strings_stop_tokens_eos_min_tokens_and_max_tokens_with_overlap(on, off):
    ps = prompts(n=6, seed=3)
    plain = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    free_run, _ = run(off, ps, plain)
    # A 3-digit word after the first token: " w123" matches that word only.
    free = free_run[0][0]
    stop_word = next(t for t in free[4:] if t >= 100)
    stop_at = free.index(stop_word, 1) + 1
    stop_id = free_run[1][0][4]
    params = [
        SamplingParams(temperature=0, max_tokens=30, stop=[f" w{stop_word}"]),
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_id]),
        # eos is forced, and masked for the first 3 tokens: it ends the request as its 4th
        SamplingParams(temperature=0, max_tokens=30, min_tokens=3, logit_bias={EOS: 100.0}),
        SamplingParams(temperature=0.8, seed=5, max_tokens=30, min_tokens=8,
                       stop_token_ids=[stop_id], logit_bias={stop_id: 100.0}),
        SamplingParams(temperature=0, max_tokens=1),
        SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
    ]  # fmt: skip
    got, _ = run(on, ps, params)
    want, _ = run(off, ps, params)
    assert got == want
    reasons = [(t[2], t[3]) for t in got]
    assert reasons[0] == ("stop", f" w{stop_word}") and len(got[0][0]) == stop_at
    assert reasons[1] == ("stop", stop_id) and got[1][0][-1] == stop_id
    assert reasons[2] == ("stop", None) and got[2][0][-1] == EOS and len(got[2][0]) == 4
    assert reasons[3] == ("stop", stop_id) and len(got[3][0]) == 9  # 8 under min_tokens
    assert [len(t[0]) for t in got[4:]] == [1, 2] and reasons[4:] == [("length", None)] * 2


def drive(engine, add, abort_at: dict[int, list[str]], max_steps=300) -> dict[str, list]:
    """Step ``engine`` until done, aborting ``abort_at[step]`` before that step; returns the
    outputs each request emitted."""
    emitted: dict[str, list] = {}
    add(engine)
    for i in range(max_steps):
        for rid in abort_at.get(i, []):
            assert engine.abort_request(rid)
        if not engine.has_unfinished_requests():
            return emitted
        for out in engine.step():
            emitted.setdefault(out.request_id, []).append(out)
    raise AssertionError("the engine did not finish")


@pytest.mark.parametrize("abort_step", [1, 2, 5])
def test_aborts_mid_generation_emit_nothing_after_and_leak_nothing(on, off, abort_step):
    ps = prompts(n=4, lo=10, hi=40, seed=7)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)

    def add(engine):
        for i, p in enumerate(ps):
            engine.add_request(f"r{i}", p, params)

    results = []
    for llm in (on, off):
        emitted = drive(llm.engine, add, {abort_step: ["r1", "r3"]})
        llm.engine.check_integrity()
        stats = llm.engine.get_stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
        for rid in ("r0", "r2"):
            outs = emitted[rid]
            assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        for rid in ("r1", "r3"):  # nothing after the abort, never a finished output
            assert not any(o.finished for o in emitted.get(rid, []))
        tokens = {rid: [t for o in outs for t in o.new_token_ids] for rid, outs in emitted.items()}
        results.append(tokens)
    got, want = results
    assert got["r0"] == want["r0"] and got["r2"] == want["r2"] and len(got["r0"]) == 20
    # With overlap the aborted requests' tokens arrive one step later: fewer or as many.
    for rid in ("r1", "r3"):
        assert got.get(rid, []) == want.get(rid, [])[: len(got.get(rid, []))]


def test_an_abort_that_leaves_only_a_step_in_flight_ends_cleanly(on):
    engine = on.engine
    engine.add_request("only", prompts(n=1, seed=2)[0], SamplingParams(temperature=0, max_tokens=9))
    engine.step()  # its prefill is in flight
    engine.step()  # the prefill's token comes back; a decode is in flight
    assert engine.abort_request("only")
    assert engine.has_unfinished_requests()  # the decode in flight is still to be read
    assert engine.step() == []  # its token is dropped; the runner frees its sampling slot
    assert not engine.has_unfinished_requests()
    assert engine.worker.runner.sampling.num_used_slots == 0
    engine.check_integrity()


def test_seeded_sampling_through_preemption_with_overlap_equals_a_roomy_serial_pool(off, tiny_dir):
    ps = prompts(n=5, lo=40, hi=60, seed=8)
    params = [
        SamplingParams(temperature=0.9, top_k=50, seed=100 + i, max_tokens=40, min_tokens=30,
                       stop_token_ids=[EOS], frequency_penalty=0.4, repetition_penalty=1.2)
        for i in range(len(ps))
    ]  # fmt: skip
    roomy, _ = run(off, ps, params)
    small = tiny_llm(tiny_dir, num_gpu_blocks_override=14)  # 13 usable blocks of 16 tokens
    assert small.engine.overlap_schedule
    preempted = record_preemptions(small.engine)
    got, fed = run(small, ps, params)
    assert preempted, "the pool was large enough: no preemption happened"
    assert fed > 0 and got == roomy


def test_the_flag_turns_overlap_off_and_bad_values_are_refused():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(["--disable-overlap-schedule"]))
    assert args.disable_overlap_schedule is True
    assert EngineArgs.from_cli_args(parser.parse_args([])).disable_overlap_schedule is False
    with pytest.raises(ValueError, match="disable_overlap_schedule='yes' is invalid"):
        SchedulerConfig(disable_overlap_schedule="yes")


def test_a_delay_factor_holds_arrivals_while_requests_run_and_changes_no_token(tiny_dir, on):
    """``scheduler_delay_factor`` end to end, overlap on: a prompt that arrives while another
    request runs waits (a factor this large holds it until nothing runs), then runs to the same
    greedy tokens as without the factor; the pool is whole afterwards."""
    held = tiny_llm(tiny_dir, max_num_batched_tokens=48, scheduler_delay_factor=1e6)
    assert held.engine.scheduler.delay_factor == 1e6
    ps = prompts(n=2, seed=5)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def drive(llm) -> tuple[dict[str, list[int]], int]:
        engine = llm.engine
        tokens: dict[str, list[int]] = {"a": [], "b": []}
        engine.add_request("a", ps[0], params)
        for _ in range(3):
            for o in engine.step():
                tokens[o.request_id] += o.new_token_ids
        engine.add_request("b", ps[1], params)
        admitted_while_a_ran = 0
        while engine.has_unfinished_requests():
            a = engine.scheduler.get_request("a")
            b = engine.scheduler.get_request("b")
            if a is not None and a.status.name == "RUNNING" and b is not None:
                admitted_while_a_ran += b.status.name == "RUNNING"
            for o in engine.step():
                tokens[o.request_id] += o.new_token_ids
        engine.check_integrity()
        stats = engine.get_stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
        return tokens, admitted_while_a_ran

    got, admitted_held = drive(held)
    want, admitted_plain = drive(on)
    assert got == want and [len(t) for t in got.values()] == [12, 12]
    assert admitted_plain > 0  # without the factor b joins the running batch
    assert admitted_held == 0  # with it, b waited until a was gone
