"""benchmarks/benchmark_accuracy.py: the rules with synthetic numbers, the data set, the plumbing
through a fake ``LLM``, and (slow) the harness itself in float32 on CPU on the default GGUF over
six short prompts and eight CPU paths (eager, overlap off, small chunks, prefix hit, preemption,
both host-tier swap-in modes, the tiny MoE), each of which must equal HF float32 greedily with
mean |Δ logprob| <= 1e-3 and show its feature was exercised (preemptions, cache and host hits).
The PD path (two more engines, about 40 s) runs in the harness but not here."""

from __future__ import annotations

import json
import math
import os

import pytest
from support import load_benchmark_module

harness = load_benchmark_module("benchmark_accuracy")
from accuracy import data, metrics, paths, runner  # noqa: E402  (benchmarks/ is on sys.path now)
from accuracy.metrics import Divergence, PathScore, judge  # noqa: E402
from accuracy.reference import PromptReference, Reference  # noqa: E402
from accuracy.report import score  # noqa: E402

# --- the rules, synthetic numbers -------------------------------------------------------------


def test_cut_and_first_divergence():
    assert metrics.cut_at_eos([5, 6, 2, 7], [2]) == [5, 6, 2]
    assert metrics.cut_at_eos([5, 6], [2]) == [5, 6]
    assert metrics.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert metrics.first_divergence([1, 9, 3], [1, 2, 3]) == 1
    assert metrics.first_divergence([1, 2, 2], [1, 2]) == 2  # one side stopped at eos


def test_margin_deltas_perplexity():
    assert metrics.top2_margin([-0.1, -3.0, -0.4]) == pytest.approx(0.3)
    assert metrics.top2_margin([-1.0, -1.0]) == 0.0
    with pytest.raises(ValueError, match=">= 2"):
        metrics.top2_margin([0.0])
    assert metrics.abs_deltas([None, -1.0, -2.5], [None, -1.5, -2.0]) == [0.5, 0.5]
    with pytest.raises(ValueError, match="length"):
        metrics.abs_deltas([None], [None, -1.0])
    assert metrics.perplexity([None, -1.0, -3.0]) == pytest.approx(math.exp(2.0))
    with pytest.raises(ValueError):
        metrics.perplexity([None])


def _score(dtype, divergences=(), deltas=(0.0,), problems=()):
    return PathScore("p", dtype, 4, 4 - len(divergences), list(divergences), list(deltas),
                     problems=list(problems))  # fmt: skip


def test_float32_rule():
    assert judge(_score("float32", deltas=[1e-4, 5e-4]))[0]
    ok, why = judge(_score("float32", [Divergence(3, 7, 0.001)]))
    assert not ok and "divergence" in why[0]  # even at a near-tie: float32 must be exact
    ok, why = judge(_score("float32", deltas=[2e-3, 1e-3]))
    assert not ok and "1e-03" in why[0]
    ok, why = judge(_score("float32", problems=["not exercised: num_preemptions = 0"]))
    assert not ok and "not exercised" in why[0]


def test_bfloat16_rule_near_ties_and_torch_yardstick():
    tie = Divergence(0, 3, metrics.NEAR_TIE / 2)
    assert judge(_score("bfloat16", [tie], [0.02]), torch_mean=0.02)[0]
    ok, why = judge(_score("bfloat16", [Divergence(1, 0, 0.5)], [0.02]), torch_mean=0.02)
    assert not ok and "p1@0" in why[0]
    assert not judge(_score("bfloat16", [Divergence(1, 0, None)]), torch_mean=1.0)[0]
    assert judge(_score("bfloat16", deltas=[0.0219]), torch_mean=0.02)[0]  # within 10%
    ok, why = judge(_score("bfloat16", deltas=[0.0221]), torch_mean=0.02)
    assert not ok and "torch path" in why[0]
    ok, why = judge(_score("bfloat16", deltas=[0.5]), torch_mean=None)
    assert ok and "not checked" in why[0]


def test_bfloat16_near_tie_bound_follows_the_torch_path():
    """3 standard deviations of the yardstick's top-2 gap error (mean |Δ| * sqrt(pi) each),
    never below the random-weight bound: the H200 run's torch mean 0.0493 gives 0.262."""
    assert metrics.near_tie_bound(0.0493) == pytest.approx(0.2621, abs=1e-3)
    assert metrics.near_tie_bound(0.001) == metrics.NEAR_TIE
    assert metrics.near_tie_bound(None) == metrics.NEAR_TIE
    at_015 = _score("bfloat16", [Divergence(2, 5, 0.15)], [0.04])
    assert judge(at_015, torch_mean=0.0493)[0]
    ok, why = judge(at_015, torch_mean=None)
    assert not ok and "0.060" in why[0] and any("random-weight" in w for w in why)
    assert not judge(_score("bfloat16", [Divergence(2, 5, 0.27)], [0.04]), torch_mean=0.0493)[0]


def _ref(cont, margins):
    return PromptReference([7, 8, 9], cont, [-0.5] * len(cont), margins, [None, -1.0, -2.0])


def test_score_finds_divergences_margins_and_missing_evidence():
    ref = Reference([_ref([4, 5, 2], [1.0, 0.01, 2.0]), _ref([4, 5], [0.3, 0.4])], [None, -1.0])
    run = runner.PathRun(
        greedy=[[4, 6, 2], [4, 5, 2, 9]],  # diverges at 1; stops at eos where HF went on
        greedy_logprobs=[[-0.5, -0.7, -0.1], [-0.4, -0.5, -0.1, -0.1]],
        prompt_logprobs=[[None, -1.0, -2.0005], [None, -1.0, -2.0]],
        text_logprobs=[None, -1.0],
        evidence={"num_preemptions": 0},
    )
    s = score(paths.PATHS["preemption"], run, ref, "float32", [2], [10, 11])
    assert s.num_equal == 0
    assert s.divergences == [Divergence(10, 1, 0.01), Divergence(11, 2, None)]
    assert s.gen_delta_max == pytest.approx(0.1) and s.prompt_delta_max == pytest.approx(5e-4)
    assert s.ppl_ours == s.ppl_ref == pytest.approx(math.e)
    assert s.problems == ["not exercised: num_preemptions = 0"]


# --- paths ------------------------------------------------------------------------------------


def test_paths_parse_and_pool_sizing():
    assert [p.name for p in paths.parse_paths("moe,torch")] == ["torch", "moe"]
    with pytest.raises(ValueError, match="valid: torch"):
        paths.parse_paths("eager,warp-speed")
    assert "piecewise" not in paths.CPU_PATHS and "host-layerwise" in paths.CPU_PATHS
    common = dict(dtype="float32", device="cpu", prompt_lengths=[40, 20], text_length=100,
                  max_new_tokens=24, kv_bytes_per_token=1 << 20)  # fmt: skip
    tight = paths.engine_kwargs(paths.PATHS["preemption"], **common)
    assert tight["num_gpu_blocks_override"] == 7 + 2  # (100 + 1) / 16 rounded up, plus two
    roomy = paths.engine_kwargs(paths.PATHS["eager"], **common)
    assert roomy["num_gpu_blocks_override"] == 2 + 2 and not roomy["enable_prefix_caching"]
    host = paths.engine_kwargs(paths.PATHS["host-request"], **common)
    assert host["enable_prefix_caching"] and host["swap_space"] == pytest.approx(320 / 1024)


# --- the teacher-forced plumbing, through a fake LLM ------------------------------------------


class _Out:
    def __init__(self, ids, tokens, plp):
        self.num_cached_tokens = 0
        self.prompt_logprobs = plp
        entries = [{"token_id": t, "logprob": -0.25, "top_logprobs": []} for t in tokens]
        self.outputs = [type("C", (), {"token_ids": tokens, "logprobs": entries})()]


class FakeLLM:
    """``LLM`` as the harness uses it: greedy answers [5, 2]; prompt logprobs -1 per token."""

    def __init__(self, model=None, **kw):
        self.engine = self
        FakeLLM.env_at_build = os.environ.get("FD_USE_FUSED_OPS")

    def generate(self, prompts, params, use_tqdm=True):
        if params.prompt_logprobs is None:
            return [_Out(p, [5, 2], None) for p in prompts]
        entry = lambda t: {"token_id": t, "logprob": -1.0, "top_logprobs": []}  # noqa: E731
        return [_Out(p, [5], [None] + [entry(t) for t in p[1:]]) for p in prompts]

    def get_stats(self):
        return {"num_preemptions": 0, "steps_by_mode": {"eager": 1}}

    def shutdown(self):
        pass


def test_run_path_reads_prompt_logprobs_and_sets_env(monkeypatch):
    import fastdeploy

    monkeypatch.setattr(fastdeploy, "LLM", FakeLLM)
    monkeypatch.delenv("FD_USE_FUSED_OPS", raising=False)
    run = runner.run_path(paths.PATHS["torch"], None, {}, [[1, 2, 3]], [4, 5], 8)
    assert FakeLLM.env_at_build == "0" and "FD_USE_FUSED_OPS" not in os.environ
    assert run.greedy == [[5, 2]] and run.greedy_logprobs == [[-0.25, -0.25]]
    assert run.prompt_logprobs == [[None, -1.0, -1.0]] and run.text_logprobs == [None, -1.0]


class FakeWorkloads:
    """``harness.Workloads`` without a model: one prompt whose HF continuation is [4, 5, 2]."""

    model_path = None  # a file to take the md5 of; the test sets it
    text_ids = [1, 2]
    schema = None  # no --json-schema

    def __init__(self, args, device, records):
        pass

    def get(self, kind):
        ref = Reference([_ref([4, 5, 2], [1.0, 0.5, 2.0])], [None, -1.0])
        return harness.Workload("m", [[7, 8, 9]], [1, 2], ref, [2], [0], 4)


def test_main_exits_one_on_a_failed_path_and_lists_cuda_paths(monkeypatch, tmp_path, capsys):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(harness, "Workloads", FakeWorkloads)
    monkeypatch.setattr(FakeWorkloads, "model_path", gguf)

    # eager equals HF; chunked parts at 1
    def fake_run(spec, model, kw, prompts, text_ids, n, schema=None):
        tokens = [4, 5, 2] if spec.name == "eager" else [4, 9, 2]
        plp = [[None, -1.0, -2.0]]
        return runner.PathRun([tokens], [[-0.5] * 3], plp, [None, -1.0], {})

    monkeypatch.setattr(harness, "run_path", fake_run)
    argv = ["--device", "cpu", "--paths", "eager,piecewise,chunked", "--json", str(tmp_path / "j")]
    assert harness.main(argv) == 1
    out = capsys.readouterr().out
    assert "needs CUDA" in out and "prompt 0 at token 1, HF float32 top-2 margin 0.5000" in out
    rows = {r["path"]: r for r in json.loads((tmp_path / "j").read_text())["paths"]}
    assert rows["eager"]["passed"] and not rows["chunked"]["passed"]
    assert rows["piecewise"] == {"path": "piecewise", "skipped": "needs CUDA"}


# --- the data set -----------------------------------------------------------------------------


def test_prompt_set_mix_and_range():
    recs = data.load_prompts()
    assert len(recs) >= 64 and [r.id for r in recs] == list(range(len(recs)))
    kinds = {k: sum(r.kind == k for r in recs) for k in data.KINDS}
    assert kinds["chat"] >= 16 and kinds["text"] >= 8
    lengths = [r.num_tokens for r in recs]
    assert min(lengths) == data.MIN_PROMPT_TOKENS and 1500 <= max(lengths) <= data.MAX_PROMPT_TOKENS
    assert sum(n > 400 for n in lengths) >= 8
    firsts = [r.messages[0]["content"] for r in recs[:2]]
    assert firsts == ["What is the capital of France?", "Name three primary colors."]
    body = json.dumps([r.to_json() for r in recs], ensure_ascii=False)
    for needle in ["🌈", "长城", "東京", "def ", "#include", "SELECT", "x^3", "1. Preheat"]:
        assert needle in body, needle
    assert any(len(r.messages) >= 5 for r in recs)  # multi-turn
    assert all(r.num_tokens <= 64 for r in data.select_prompts(recs, 6))


@pytest.mark.slow
def test_prompt_token_counts_are_measured():
    from fastdeploy.model_executor.model_loader.source import resolve_model

    try:
        tok = resolve_model(None, "auto").load_tokenizer()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    for r in data.load_prompts():
        assert len(data.prompt_token_ids(tok, r)) == r.num_tokens, r.id
    assert len(data.text_token_ids(tok)) >= 2000


# --- the harness, for real --------------------------------------------------------------------

# "eager" runs with the overlap schedule on (the default); "overlap-on" differs from it only by
# asking for CUDA graphs, which the CPU platform has not, so it is left out here (about 25 s).
CPU_TEST_PATHS = ["eager", "overlap-off", "chunked", "prefix-hit", "preemption", "host-request",
                  "host-layerwise", "moe", "piecewise"]  # fmt: skip


@pytest.fixture(scope="module")
def harness_run(tmp_path_factory):
    """The harness in float32 on CPU: 6 short prompts, 32 new tokens (64 took the module to 4.2
    min on the 2-core VM, over its CI share), 256 perplexity tokens."""
    from fastdeploy.model_executor.model_loader.source import default_model_file

    try:
        default_model_file()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    out = tmp_path_factory.mktemp("acc") / "acc.json"
    argv = ["--device", "cpu", "--dtype", "float32", "--num-prompts", "6", "--max-new-tokens",
            "32", "--text-tokens", "256", "--paths", ",".join(CPU_TEST_PATHS),
            "--json", str(out)]  # fmt: skip
    status = harness.main(argv)
    doc = json.loads(out.read_text())
    return status, {row["path"]: row for row in doc["paths"]}, doc["meta"]


@pytest.mark.slow
def test_harness_exits_zero_and_names_its_setup(harness_run):
    status, rows, meta = harness_run
    assert status == 0, {p: r.get("notes", r.get("error")) for p, r in rows.items()}
    assert meta["md5"] and len(meta["md5"]) == 32 and meta["dtype"] == "float32"
    assert rows["piecewise"] == {"path": "piecewise", "skipped": "needs CUDA"}


@pytest.mark.slow
@pytest.mark.parametrize("path", [p for p in CPU_TEST_PATHS if p != "piecewise"])
def test_cpu_path_equals_hf_float32(harness_run, path):
    row = harness_run[1][path]
    assert "error" not in row, row["error"]
    assert row["num_equal"] == row["num_prompts"], row["divergences"]
    assert row["prompt_delta_mean"] <= metrics.FLOAT32_MAX_MEAN_DELTA
    assert row["ppl_ours"] == pytest.approx(row["ppl_ref"], rel=1e-3)
    assert row["problems"] == [] and row["passed"]


# --- the harness under a JSON schema (--json-schema) -------------------------------------------


@pytest.mark.slow
def test_constrained_reference_is_schema_json_and_engine_paths_equal_it(tmp_path):
    """HF's constrained greedy (accuracy/grammar.py) writes JSON the schema accepts, its masked
    margins are infinite where the grammar allows one token,, and two CPU paths under the same
    schema equal it token for token (float32)."""
    jsonschema = pytest.importorskip("jsonschema")
    from accuracy.grammar import BUILTIN_SCHEMA, compile_schema, constrained_greedy
    from accuracy.reference import load_hf_gguf

    from fastdeploy.model_executor.model_loader.source import resolve_model

    try:
        source = resolve_model(None, "auto")
    except FileNotFoundError as e:
        pytest.skip(str(e))
    tok = source.load_tokenizer()
    hf = load_hf_gguf(source.path, source.gguf_file, "cpu")
    grammar = compile_schema(tok, hf.config.vocab_size, BUILTIN_SCHEMA)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Describe a user of a website as JSON."}],
        add_generation_prompt=True,
        tokenize=False,
    )
    ids = tok.encode(text, add_special_tokens=False)
    eos = [tok.eos_token_id]
    cont, lps, margins = constrained_greedy(hf, ids, 120, eos, grammar)
    assert cont[-1] in eos and len(cont) == len(lps) == len(margins)
    doc = json.loads(tok.decode(cont[:-1]))
    jsonschema.validate(doc, BUILTIN_SCHEMA)
    assert math.inf in margins  # positions where the grammar allows one token
    assert all(lp <= 0 for lp in lps)

    out = tmp_path / "acc.json"
    argv = ["--device", "cpu", "--dtype", "float32", "--num-prompts", "2", "--max-new-tokens",
            "24", "--text-tokens", "64", "--paths", "eager,overlap-off", "--json-schema",
            "builtin", "--json", str(out)]  # fmt: skip
    assert harness.main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["meta"]["json_schema"] == "builtin"
    for row in doc["paths"]:
        assert row["num_equal"] == row["num_prompts"] == 2, row["divergences"]
        assert row["gen_delta_mean"] <= metrics.FLOAT32_MAX_MEAN_DELTA


def test_load_schema_forms(tmp_path):
    from accuracy.grammar import BUILTIN_SCHEMA, load_schema

    assert load_schema("builtin") is BUILTIN_SCHEMA
    f = tmp_path / "s.json"
    f.write_text('{"type": "object"}')
    assert load_schema(str(f)) == {"type": "object"}
    assert load_schema('{"type": "integer"}') == {"type": "integer"}
    with pytest.raises(ValueError, match="allowed: builtin"):
        load_schema("{nope")
    with pytest.raises(ValueError, match="allowed: an object"):
        load_schema("[1]")


class FakeSwitchingEngine:
    """An ``LLMEngine`` stand-in for ``capture-switch``: each request emits tokens 7, 8 over
    two steps; one graph of four is 'captured' per step (as ``GapPacer(1.0)`` does)."""

    def __init__(self):
        self.added: list[tuple[int, str]] = []  # (step, request id)
        self.steps = 0
        self.tokens: dict[str, list[int]] = {}
        self.captured = 0

    def add_request(self, rid, ids, params):
        self.added.append((self.steps, rid))
        self.tokens[rid] = [7, 8]

    def step(self):
        from fastdeploy.core.outputs import EngineOutput

        self.steps += 1
        self.captured = min(self.captured + 1, 4)
        outs = []
        for rid, left in list(self.tokens.items()):
            tok = left.pop(0)
            lp = [{"token_id": tok, "logprob": -0.5, "top_logprobs": []}]
            outs.append(EngineOutput(rid, [tok], lp, not left, "length" if not left else None))
            if not left:
                del self.tokens[rid]
        return outs

    def get_stats(self):
        return {"graph_capture": {"captured": self.captured, "total": 4}}


def test_capture_switch_path_staggers_requests_and_counts_switches():
    from accuracy import switching

    engine = FakeSwitchingEngine()
    queue = [(f"g{i}", [1, 2], None) for i in range(3)]
    outs, switches = switching._drive_staggered(engine, queue)
    assert engine.added == [(0, "g0"), (1, "g1"), (2, "g2")]  # one request per step
    assert [[t for o in outs[r] for t in o.new_token_ids] for r in outs] == [[7, 8]] * 3
    assert switches == 4  # every graph captured while a request was in flight
    assert paths.PATHS["capture-switch"].switching and paths.PATHS["capture-switch"].needs_cuda
