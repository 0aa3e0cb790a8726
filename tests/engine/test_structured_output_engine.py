"""Structured outputs in the engine with the default model (SmolLM2-135M-Instruct GGUF, CPU):
grammar and plain requests batched together give the same greedy tokens with the overlap
schedule on and off; plain requests' tokens do not change when grammar requests share their
batch, and a batch without grammar builds no bitmask; the mask is applied to grammar rows only;
a spec that does not parse is refused at ``add_request``."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from structured_cases import ASK, MIXED, REGEX, SCHEMA, params

from fastdeploy import LLM, SamplingParams
from fastdeploy.core.structured_output import StructuredOutputsParams

pytestmark = pytest.mark.slow

ENGINE = dict(max_model_len=512, max_num_seqs=4, block_size=16, num_gpu_blocks_override=200)


@pytest.fixture(scope="module")
def on():
    llm = LLM(**ENGINE)
    assert llm.engine.overlap_schedule
    return llm


@pytest.fixture(scope="module")
def off():
    llm = LLM(disable_overlap_schedule=True, **ENGINE)
    assert not llm.engine.overlap_schedule
    return llm


def run(llm, sampling):
    return [o.outputs[0] for o in llm.chat(ASK, sampling, use_tqdm=False)]


def test_mixed_batch_equal_with_overlap_on_and_off_and_plain_rows_unchanged(on, off):
    got_on, got_off = run(on, MIXED), run(off, MIXED)
    assert [o.token_ids for o in got_on] == [o.token_ids for o in got_off]
    jsonschema.validate(json.loads(got_on[0].text), SCHEMA)
    assert re.fullmatch(REGEX, got_on[1].text)
    assert got_on[0].finish_reason == got_on[1].finish_reason == "stop"
    plain = run(on, [params(None)] * 4)
    assert [o.token_ids for o in plain[2:]] == [o.token_ids for o in got_on[2:]]
    assert plain[1].text != got_on[1].text  # the regex did constrain row 1
    for llm in (on, off):
        assert not llm.engine.grammars._matchers and not llm.engine.grammars._pending  # freed
        llm.engine.check_integrity()


@pytest.mark.parametrize("which", ["on", "off"])
def test_a_batch_without_grammar_builds_no_mask_and_rows_are_counted(which, request):
    llm = request.getfixturevalue(which)
    grammars = llm.engine.grammars
    steps, rows = grammars.num_masked_steps, grammars.num_masked_rows
    out = run(llm, [params(None)] * 4)
    assert (grammars.num_masked_steps, grammars.num_masked_rows) == (steps, rows)
    assert all(o.finish_reason for o in out)
    got = run(llm, MIXED)
    # One masked row per sampled token of the two grammar requests, in as many steps as the
    # longer one took (with overlap, one more: the step in flight when it ended, whose row is
    # dropped and not filled); plain rows are never counted.
    assert grammars.num_masked_rows - rows == len(got[0].token_ids) + len(got[1].token_ids)
    longest = max(len(got[0].token_ids), len(got[1].token_ids))
    assert grammars.num_masked_steps - steps == longest + (which == "on")


def test_a_spec_that_does_not_parse_is_refused_at_add_request(on):
    with pytest.raises(ValueError, match="regex is invalid"):
        on.generate("x", params(StructuredOutputsParams(regex="a(b")), use_tqdm=False)
    on.engine.check_integrity()
    assert not on.engine.scheduler.has_unfinished_requests()


def test_overlap_defers_the_mask_until_the_forward_is_queued(on, off, monkeypatch):
    """With a step in flight, a grammar step launches with a callable mask: the runner queues
    the forward first and builds the mask after it, once per step; output is unchanged."""
    grammars, runner = on.engine.grammars, on.engine.worker.runner
    events = []
    forward, bitmask = runner.forward, grammars.bitmask

    def spy_forward(sched, *a, **kw):
        events.append("forward-deferred" if callable(sched.grammar_bitmask) else "forward")
        return forward(sched, *a, **kw)

    def spy_bitmask(sched):
        events.append("mask")
        return bitmask(sched)

    monkeypatch.setattr(runner, "forward", spy_forward)
    monkeypatch.setattr(grammars, "bitmask", spy_bitmask)
    got = run(on, MIXED)
    assert [o.token_ids for o in got] == [o.token_ids for o in run(off, MIXED)]
    deferred = [i for i, e in enumerate(events) if e == "forward-deferred"]
    assert len(deferred) >= 10, events  # every decode step of the grammar rows but the first
    for i in deferred:  # its mask is built after its forward, before the next step's forward
        assert events[i + 1] == "mask", events[i - 2 : i + 3]


def test_threaded_batch_fill_equals_the_row_loop(monkeypatch):
    """From BATCH_FILL_MIN_ROWS grammar rows on, the mask is filled by xgrammar's threaded batch
    matcher: ten seeded schema requests at once give the same tokens as with the row loop."""
    from fastdeploy.engine import structured_output

    so = StructuredOutputsParams(json=SCHEMA)
    sampling = [SamplingParams(temperature=1.0, seed=i, max_tokens=40, structured_outputs=so)
                for i in range(10)]  # fmt: skip
    asks = [ASK[0]] * 10
    on = LLM(**{**ENGINE, "max_num_seqs": 16})
    batched = [o.outputs[0].token_ids for o in on.chat(asks, sampling, use_tqdm=False)]
    assert on.engine.grammars._batch_fill is not None  # the threaded fill ran
    monkeypatch.setattr(structured_output, "BATCH_FILL_MIN_ROWS", 10**9)
    looped = [o.outputs[0].token_ids for o in on.chat(asks, sampling, use_tqdm=False)]
    assert batched == looped
    assert len({tuple(t) for t in batched}) > 1  # the seeds differ, so the samples do


def test_the_mask_buffer_is_writable_in_and_out_of_inference_mode(on):
    """The deferred mask is built in the runner's inference mode, an immediate one outside it:
    the reused buffer must take both, in either order and when it grows (a server crashed
    with 'Inplace update to inference tensor outside InferenceMode')."""
    import torch

    grammars = on.engine.grammars
    grammars._host_mask = None
    with torch.inference_mode():
        assert grammars._rows(2).eq(-1).all()
    assert grammars._rows(2).eq(-1).all()
    assert grammars._rows(6).shape[0] == 6  # grows outside
    with torch.inference_mode():
        assert grammars._rows(9).eq(-1).all()  # grows inside
    assert grammars._rows(3).eq(-1).all()


def test_a_slow_compile_never_stalls_the_step_loop(on, monkeypatch):
    """A request waits outside the scheduler while its grammar compiles: a plain request added
    after it finishes meanwhile; one whose compile outlasts FD_STRUCTURED_OUTPUT_COMPILE_TIMEOUT_S
    ends with a ValueError naming the limit; an abort while compiling frees it; a compile that
    ends in time runs normally."""
    import threading
    import time

    eng = on.engine
    grammars = eng.grammars
    release = threading.Event()
    compile_ = grammars._compile

    def slow(kind, spec):
        release.wait(10)
        return compile_(kind, spec)

    monkeypatch.setattr(grammars, "_compile", slow)
    monkeypatch.setenv("FD_STRUCTURED_OUTPUT_COMPILE_TIMEOUT_S", "0.5")
    ids = eng.tokenizer.encode("Describe the capital of France as JSON.")
    unique = {**SCHEMA, "description": "slow-compile test"}  # not in the compile cache
    eng.add_request("slow", ids, params(StructuredOutputsParams(json=unique)))
    eng.add_request("plain", ids, SamplingParams(temperature=0, max_tokens=8))
    assert "slow" in eng.compiling and eng.get_stats()["num_waiting"] >= 1
    outs, start = {}, time.monotonic()
    while eng.has_unfinished_requests() and time.monotonic() - start < 30:
        for o in eng.step():
            outs.setdefault(o.request_id, []).append(o)
    assert outs["plain"][-1].finished and outs["plain"][-1].error is None
    slow_out = outs["slow"][-1]
    assert slow_out.finished and isinstance(slow_out.error, ValueError)
    assert "FD_STRUCTURED_OUTPUT_COMPILE_TIMEOUT_S" in str(slow_out.error)
    assert not eng.compiling and not grammars._pending
    release.set()

    other = {**SCHEMA, "description": "abort test"}
    release.clear()
    eng.add_request("gone", ids, params(StructuredOutputsParams(json=other)))
    assert eng.abort_request("gone") and not eng.compiling and not eng.has_unfinished_requests()
    release.set()

    monkeypatch.setenv("FD_STRUCTURED_OUTPUT_COMPILE_TIMEOUT_S", "30")
    late = {**SCHEMA, "description": "in time"}
    eng.add_request("late", ids, params(StructuredOutputsParams(json=late)))
    tokens = []
    while eng.has_unfinished_requests():
        for o in eng.step():
            assert o.error is None
            tokens += o.new_token_ids
    jsonschema.validate(json.loads(eng.tokenizer.decode(tokens[:-1])), SCHEMA)
    eng.check_integrity()
