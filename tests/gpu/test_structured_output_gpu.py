"""Structured outputs on CUDA with the real default model (bfloat16, CUDA graphs on).

Grammar rows decode in full decode graphs (the mask is applied to the replay's logits in the
persistent device buffer, by xgrammar's CUDA kernel), give the same greedy tokens as the engine
with graphs off, and give JSON the schema accepts and text the regex matches; 64 concurrent
schema requests are all valid; plain rows batched with grammar rows are unchanged.
"""

from __future__ import annotations

import json
import re

import pytest
from structured_cases import ASK, MIXED, REGEX, SCHEMA, params

from fastdeploy import LLM, SamplingParams
from fastdeploy.core.structured_output import StructuredOutputsParams

jsonschema = pytest.importorskip("jsonschema", reason="the schema check needs jsonschema")
pytest.importorskip("xgrammar", reason="structured outputs need xgrammar")


def engine(model: str, graphs: bool) -> LLM:
    return LLM(
        model,
        device="cuda",
        dtype="bfloat16",
        max_model_len=1024,
        max_num_seqs=64,
        block_size=16,
        graph_optimization_config={"use_cudagraph": graphs},
    )


@pytest.fixture(scope="module")
def graph_llm(real_gguf):
    llm = engine(real_gguf, True)
    yield llm
    llm.engine.shutdown()


def run(llm, sampling, asks=ASK):
    return [o.outputs[0] for o in llm.chat(asks, sampling, use_tqdm=False)]


def test_grammar_rows_replay_full_graphs_and_equal_graphs_off(graph_llm, real_gguf):
    # Compiled grammars first: a request waits outside the scheduler while its grammar compiles,
    # so a cold run admits the plain rows a step before the grammar rows, and the two engines'
    # batches (hence their bfloat16 kernels) would differ by when each compile ended.
    run(graph_llm, MIXED)
    stats = graph_llm.engine.get_stats
    before = dict(stats()["steps_by_mode"])
    masked = graph_llm.engine.grammars.num_masked_steps
    got = run(graph_llm, MIXED)
    after = stats()["steps_by_mode"]
    modes = {k: after[k] - before.get(k, 0) for k in after}
    print("steps by mode, mixed grammar batch:", modes,
          "masked steps:", graph_llm.engine.grammars.num_masked_steps - masked)  # fmt: skip
    assert modes["full"] > 0 and graph_llm.engine.grammars.num_masked_steps > masked
    jsonschema.validate(json.loads(got[0].text), SCHEMA)
    assert re.fullmatch(REGEX, got[1].text), got[1].text
    assert got[0].finish_reason == got[1].finish_reason == "stop"
    plain = run(graph_llm, [params(None)] * 4)
    assert [o.token_ids for o in plain[2:]] == [o.token_ids for o in got[2:]]

    eager = engine(real_gguf, False)
    try:
        run(eager, MIXED)  # compiled grammars, as above
        ref = run(eager, MIXED)
        assert eager.engine.get_stats()["steps_by_mode"]["full"] == 0
    finally:
        eager.engine.shutdown()
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]


def test_64_schema_requests_at_once_are_all_valid(graph_llm):
    asks = [[{"role": "user", "content": f"Describe city number {i} as JSON."}] for i in range(64)]
    so = StructuredOutputsParams(json=SCHEMA)
    sampling = SamplingParams(temperature=0.8, seed=1, max_tokens=120, structured_outputs=so)
    outs = run(graph_llm, sampling, asks)
    for o in outs:
        assert o.finish_reason == "stop", (o.finish_reason, o.text)
        jsonschema.validate(json.loads(o.text), SCHEMA)
    graph_llm.engine.check_integrity()
