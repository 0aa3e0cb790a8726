"""The model runner's capture loops and graph dispatch, on CPU.

No CUDA graph can be captured here, so a stand-in for ``CudaGraphRunner`` records what the runner
hands it and "replays" a bucket by running the model eagerly on the padded inputs (what a replay
computes). That checks the runner's side of the contract: each bucket is captured from a prepared
step of exactly its size, largest first, and each step replays the bucket the plan's dispatch picks,
with padded rows that change no real token.
"""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import tiny_llama

from fastdeploy import LLM, SamplingParams
from fastdeploy.core.request import Request
from fastdeploy.core.scheduler_output import ScheduledRequest, SchedulerOutput
from fastdeploy.model_executor.forward_meta import ForwardMeta
from fastdeploy.model_executor.graph_optimization.policy import GraphPlan

TINY = tiny_llama()

PLAN = GraphPlan(
    decode_graphs=True,
    prefill_graphs=True,
    decode_capture_sizes=[4, 2, 1],
    prefill_capture_sizes=[64, 16],
)


class EagerGraphs:
    """Stands in for ``CudaGraphRunner``: records captures and replays; a replay runs the model
    eagerly on the padded inputs the runner prepared. With ``capture_logits`` a full replay also
    computes what a captured tail does (every row's logits and their argmax) for
    ``decode_logits``, and ``sampled_logits`` after a piecewise replay what a sampled-row graph
    of the smallest bucket in ``sampled_sizes`` does: the logits and argmax of the rows the
    runner's ``logits_indices`` buffer names (clamped into the hidden rows)."""

    def __init__(
        self, runner, plan: GraphPlan, capture_logits: bool = False, sampled_sizes=()
    ) -> None:
        self.runner, self.plan = runner, plan
        self.capture_logits = capture_logits
        self.tails: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.captured: list[tuple] = []
        self.replayed: list[tuple[str, int, int]] = []
        self.max_positions: list[int] = []  # per captured prefill bucket
        self.piecewise: dict[int, None] = {}
        self.sampled_sizes = sorted(sampled_sizes)
        self.sampled_asked: list[int] = []  # sampled rows of each piecewise step
        self.sampled_replays: list[tuple[int, int]] = []  # (bucket, sampled rows)
        self._hidden: torch.Tensor | None = None  # of the last piecewise replay

    def capture_piecewise(self, num_tokens, input_ids, positions, forward_meta) -> None:
        self.captured.append(("prefill", num_tokens, input_ids.numel(), positions.numel()))
        self.max_positions.append(int(positions[:num_tokens].max()))
        self.piecewise[num_tokens] = None

    def capture_sampled_logits(self, rows, logits_indices) -> None:
        assert logits_indices is self.runner.buffers.logits_indices
        self.captured.append(("sampled", rows))

    def sampled_logits(self, num_rows):
        self.sampled_asked.append(num_rows)
        fits = [b for b in self.sampled_sizes if b >= num_rows]
        if not fits:
            return None
        self.sampled_replays.append((fits[0], num_rows))
        hidden = self._hidden
        index = self.runner.buffers.logits_indices[: fits[0]].clamp(0, hidden.shape[0] - 1)
        logits = self.runner.model.compute_logits(hidden[index])
        return logits, logits.argmax(dim=-1)

    def capture_full_decode(self, batch_size, input_ids, positions, batch, forward_meta) -> None:
        assert forward_meta.kv_caches is self.runner.kv_caches
        self.captured.append(
            ("decode", batch_size, input_ids.numel(), batch.num_reqs, batch.is_decode_only)
        )

    def _run(self, input_ids, meta):
        positions = self.runner.buffers.positions[: input_ids.numel()]
        return self.runner.model(input_ids, positions, meta)

    def replay_full(self, bucket, input_ids, batch):
        self.replayed.append(("full", bucket, input_ids.numel()))
        backend = self.runner.attn_backend
        meta = ForwardMeta(backend, backend.build_metadata(batch), self.runner.kv_caches)
        hidden = self._run(input_ids, meta)
        if self.capture_logits:
            logits = self.runner.model.compute_logits(hidden)
            self.tails[bucket] = (logits, logits.argmax(dim=-1))
        return hidden

    def decode_logits(self, bucket):
        return self.tails[bucket] if self.capture_logits else None

    def replay_piecewise(self, bucket, input_ids, forward_meta):
        self.replayed.append(("piecewise", bucket, input_ids.numel()))
        self._hidden = self._run(input_ids, forward_meta)
        return self._hidden


def capture_all(runner, plan: GraphPlan, capture_logits: bool = False) -> EagerGraphs:
    """Run the runner's two capture loops against an :class:`EagerGraphs` of ``plan``."""
    fake = EagerGraphs(runner, plan, capture_logits)
    runner.graph_runner = fake
    try:
        runner.capture_model_prefill_and_mixed()
        runner.capture_model()
    finally:
        runner.graph_runner = None
    return fake


def plan_of(prefill: list[int], decode: list[int]) -> GraphPlan:
    return GraphPlan(
        decode_graphs=bool(decode),
        prefill_graphs=bool(prefill),
        decode_capture_sizes=decode,
        prefill_capture_sizes=prefill,
    )


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_llama_runner")
    (d / "config.json").write_text(json.dumps(TINY))
    return LLM(
        str(d),
        load_format="dummy",
        skip_tokenizer_init=True,
        max_model_len=256,
        block_size=16,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        seed=0,
    )


def test_capture_loops_capture_every_bucket_largest_first_from_exact_steps(llm):
    fake = capture_all(llm.engine.worker.runner, PLAN)
    assert fake.captured == [
        ("prefill", 64, 64, 64),
        ("prefill", 16, 16, 16),
        ("decode", 4, 4, 4, True),
        ("decode", 2, 2, 2, True),
        ("decode", 1, 1, 1, True),
    ]


def test_with_the_decode_graphs_logits_sampled_row_buckets_follow_the_decode_buckets(llm):
    fake = capture_all(llm.engine.worker.runner, PLAN, capture_logits=True)
    assert [c[:2] for c in fake.captured] == [
        ("prefill", 64), ("prefill", 16), ("decode", 4), ("decode", 2), ("decode", 1),
        ("sampled", 4), ("sampled", 2), ("sampled", 1),
    ]  # fmt: skip
    # No piecewise bucket (prefill graphs off): no sampled-row graphs either.
    fake = capture_all(llm.engine.worker.runner, plan_of([], [2, 1]), capture_logits=True)
    assert [c[0] for c in fake.captured] == ["decode", "decode"]


def test_piecewise_steps_sample_the_rows_of_their_sampled_row_graph(llm):
    """A piecewise step takes its sampled rows' logits and argmax from the smallest sampled-row
    bucket that holds them, in the order of ``logits_indices``; a step with more sampled rows
    than the largest bucket computes them itself. Greedy, seeded and logprob rows equal the
    eager steps'."""
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (6, 19, 30, 12)]
    params = [
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=4, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=0, logprobs=2, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
    ]
    runner = llm.engine.worker.runner

    def run():
        return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]

    eager = run()
    for sizes in ((4, 2, 1), (2, 1)):
        fake = EagerGraphs(runner, PLAN, capture_logits=True, sampled_sizes=sizes)
        runner.graph_runner = fake
        try:
            graphs = run()
        finally:
            runner.graph_runner = None
        assert [o.token_ids for o in graphs] == [o.token_ids for o in eager]
        for a, b in zip(graphs[2].logprobs, eager[2].logprobs):
            assert a["token_id"] == b["token_id"] and abs(a["logprob"] - b["logprob"]) < 1e-5
        pieces = sum(kind == "piecewise" for kind, _, _ in fake.replayed)
        assert len(fake.sampled_asked) == pieces  # each piecewise step asked once
        fitting = [n for n in fake.sampled_asked if n <= max(sizes)]
        assert fake.sampled_replays == [(min(b for b in sizes if b >= n), n) for n in fitting]
        if sizes == (2, 1):  # 4 prompts sampled in one step: outside the graphs
            assert max(fake.sampled_asked) == 4 and len(fitting) < pieces
        else:
            assert fitting == fake.sampled_asked


def test_steps_replay_the_bucket_dispatch_picks_and_padding_changes_nothing(llm):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 11, 40)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    runner = llm.engine.worker.runner
    eager = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    before = dict(runner.steps_by_mode)
    fake = EagerGraphs(runner, PLAN)
    runner.graph_runner = fake
    try:
        graphs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        runner.graph_runner = None
    assert graphs == eager
    kinds = {kind for kind, _, _ in fake.replayed}
    assert kinds == {"full", "piecewise"}, fake.replayed
    for kind, bucket, rows in fake.replayed:
        assert rows == bucket  # the runner prepared the step padded to the bucket
        assert bucket in (
            PLAN.decode_capture_sizes if kind == "full" else PLAN.prefill_capture_sizes
        )
    steps = {m: runner.steps_by_mode[m] - before[m] for m in before}
    assert steps["full"] + steps["piecewise"] == len(fake.replayed)


def test_full_steps_sample_the_logits_and_argmax_their_graph_computed(llm):
    """With ``capture_logits`` a full decode step takes the logits and argmax its graph computed
    (the stand-in computes them in its replay): the runner computes logits only for the other
    steps and hands the sampler the graph's argmax, and the greedy tokens equal eager ones."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (7, 20, 33)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    runner = llm.engine.worker.runner
    eager = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    fake = EagerGraphs(runner, PLAN, capture_logits=True)
    model, sampler = runner.model, runner.sampler
    calls = {"logits": 0, "given": 0, "sampled": 0}

    def compute_logits(*args, **kwargs):
        calls["logits"] += 1
        return type(model).compute_logits(model, *args, **kwargs)

    def sample(logits, meta, argmax=None):
        calls["sampled"] += 1
        calls["given"] += argmax is not None
        return sampler(logits, meta, argmax)

    runner.graph_runner, runner.sampler, model.compute_logits = fake, sample, compute_logits
    try:
        graphs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        runner.graph_runner, runner.sampler = None, sampler
        del model.compute_logits
    assert graphs == eager
    full = sum(kind == "full" for kind, _, _ in fake.replayed)
    assert full > 0 and full < calls["sampled"]  # piecewise steps sampled too
    assert calls["given"] == full  # every full step handed the graph's argmax over
    assert calls["logits"] == calls["sampled"]  # once a step: the stand-in's, or the runner's


def test_full_steps_sample_seeded_and_logprob_rows_from_the_graph_logits(llm):
    """Seeded random rows, a greedy row with logprobs and a penalised row share full steps whose
    logits come from the graph: tokens and logprobs equal the eager steps' (the seeded rows draw
    from their own generators, so equal logits give equal tokens)."""
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (9, 17, 26, 3)]
    params = [
        SamplingParams(temperature=0.8, seed=11, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0, logprobs=2, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=1.2, top_k=20, seed=5, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=7, ignore_eos=True),
    ]
    runner = llm.engine.worker.runner

    def run():
        return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]

    eager = run()
    fake = EagerGraphs(runner, PLAN, capture_logits=True)
    runner.graph_runner = fake
    try:
        graphs = run()
    finally:
        runner.graph_runner = None
    assert any(kind == "full" for kind, _, _ in fake.replayed)
    assert [o.token_ids for o in graphs] == [o.token_ids for o in eager]
    got, want = graphs[1].logprobs, eager[1].logprobs
    assert len(got) == len(want) == 7
    for a, b in zip(got, want):
        assert a["token_id"] == b["token_id"]
        assert [t for t, _ in a["top_logprobs"]] == [t for t, _ in b["top_logprobs"]]
        assert abs(a["logprob"] - b["logprob"]) < 1e-5


def test_a_full_step_samples_the_graph_rows_of_its_sampling_requests_only(llm):
    """A decode-only step can hold a row that does not sample: a one-token prefill chunk short
    of its prompt's end. Here that row comes first, so the graph's first rows are not the
    sampling ones: the runner must pick the sampling request's row of the graph's logits and
    argmax (its token then equals the eager step's)."""
    runner = llm.engine.worker.runner
    g = torch.Generator().manual_seed(2)

    def request(name: str, n: int, block: int) -> Request:
        ids = torch.randint(3, 512, (n,), generator=g).tolist()
        req = Request(name, ids, SamplingParams(temperature=0))
        req.block_ids = [block]  # the engine holds no request: these blocks are free
        return req

    runner.reset_sampling_state()  # an earlier generate's last requests still hold slots
    chunk, last = request("chunk", 5, 1), request("last", 4, 2)
    runner.execute_model(SchedulerOutput(scheduled=[ScheduledRequest(last, 0, 3)]))
    step = SchedulerOutput(scheduled=[ScheduledRequest(chunk, 0, 1), ScheduledRequest(last, 3, 1)])
    assert step.is_decode_only and [s.samples for s in step.scheduled] == [False, True]
    eager = runner.execute_model(step)
    fake = EagerGraphs(runner, PLAN, capture_logits=True)
    runner.graph_runner = fake
    try:
        graph = runner.execute_model(step)
    finally:
        runner.graph_runner = None
        runner.reset_sampling_state()
    assert fake.replayed == [("full", 2, 2)]
    assert list(graph) == ["last"]
    assert graph["last"].token_id == eager["last"].token_id
    # The graph's first row (the chunk's) would be another token: the check can tell.
    assert int(fake.tails[2][1][0]) != eager["last"].token_id


def test_one_request_engine_captures_a_bucket_of_its_whole_block_table(tmp_path):
    # max_num_seqs=1: the default token budget is max_model_len (64 tokens, 4 blocks of 16),
    # and the 64-token bucket must be captured from one request filling its block table.
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    one = LLM(str(tmp_path), load_format="dummy", skip_tokenizer_init=True, max_model_len=64,
              block_size=16, max_num_seqs=1, seed=0)  # fmt: skip
    assert one.engine.config.scheduler_config.max_num_batched_tokens == 64
    fake = capture_all(one.engine.worker.runner, plan_of([64, 16], [1]))
    assert fake.captured == [
        ("prefill", 64, 64, 64),
        ("prefill", 16, 16, 16),
        ("decode", 1, 1, 1, True),
    ]


def test_capture_steps_keep_positions_below_max_model_len(tmp_path):
    # max_model_len=60 is not a multiple of the 16-token block: a 64-token bucket fits one
    # request's block table (4 blocks) but not its RoPE positions, so it is captured as two.
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    llm = LLM(str(tmp_path), load_format="dummy", skip_tokenizer_init=True, max_model_len=60,
              block_size=16, max_num_seqs=2, seed=0)  # fmt: skip
    fake = capture_all(llm.engine.worker.runner, plan_of([64], []))
    assert [c[1] for c in fake.captured] == [64]
    assert fake.max_positions == [31]  # two requests of 32 tokens


def test_graph_memory_estimate_counts_the_shared_logits_buffer_on_one_gpu():
    """The KV budget keeps room for the decode graphs' shared logits buffer ([largest decode
    bucket, vocab] of the model dtype) where the graphs capture it (one GPU), not under tensor
    parallelism."""
    from types import SimpleNamespace

    from fastdeploy.worker.gpu_worker import GpuWorker

    hf = SimpleNamespace(hidden_size=576, vocab_size=49152)
    worker = SimpleNamespace(
        graph_plan=plan_of([512, 16], [64, 8, 1]), dtype=torch.bfloat16,
        source=SimpleNamespace(hf_config=hf), num_heads=9, head_dim=64, num_kv_heads=3, tp=None,
    )  # fmt: skip

    def estimate(tp):
        worker.tp = tp
        worker.graphs_capture_logits = GpuWorker.graphs_capture_logits.fget(worker)
        return worker.graphs_capture_logits, GpuWorker.estimate_graph_memory(worker, 10_000)

    one, with_logits = estimate(None)
    tp, without = estimate(SimpleNamespace(world_size=2))
    assert one and not tp
    assert with_logits - without == 64 * 49152 * 2
