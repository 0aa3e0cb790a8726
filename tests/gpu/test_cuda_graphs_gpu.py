"""CUDA graphs on the GPU: replay equals eager, generations equal graphs-off and HF, lifecycle.

Run on a CUDA host: ``python -m pytest -q -m gpu tests/gpu``.
"""

from __future__ import annotations

import pytest
import torch
from gpu_utils import (
    GRAPH_LOGIT_ATOL,
    assert_greedy_matches_hf,
    greedy,
    hf_reference,
    make_llm,
    preset_dir,
    random_prompts,
)

from fastdeploy import SamplingParams
from fastdeploy.core.request import Request
from fastdeploy.core.scheduler_output import ScheduledRequest, SchedulerOutput

GRAPHS = {"use_cudagraph": True, "full_cuda_graph": False}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return preset_dir(tmp_path_factory, "smollm2-135m")


@pytest.fixture(scope="module")
def llm(model_dir):
    llm = make_llm(model_dir, graph_optimization_config=GRAPHS, num_gpu_blocks_override=512)
    graphs = llm.engine.worker.runner.graph_runner
    assert graphs is not None and graphs.piecewise and graphs.full
    yield llm
    llm.engine.shutdown()


class StepBuilder:
    """Hand-made steps over real KV blocks (blocks handed out consecutively from 1)."""

    def __init__(self, llm, seed: int = 0) -> None:
        self.runner = llm.engine.worker.runner
        self.block_size = llm.engine.config.cache_config.block_size
        self.vocab = llm.engine.vocab_size
        self.next_block = 1
        self.gen = torch.Generator().manual_seed(seed)
        self.n = 0

    def request(self, num_tokens: int) -> Request:
        ids = torch.randint(10, self.vocab, (num_tokens,), generator=self.gen).tolist()
        req = Request(f"r{self.n}", ids, SamplingParams(temperature=0))
        self.n += 1
        nblocks = -(-(num_tokens + 8) // self.block_size)
        req.block_ids = list(range(self.next_block, self.next_block + nblocks))
        self.next_block += nblocks
        return req

    @staticmethod
    def step(*parts: tuple[Request, int, int]) -> SchedulerOutput:
        return SchedulerOutput(scheduled=[ScheduledRequest(r, a, n) for r, a, n in parts])

    def fill(self, req: Request, upto: int) -> None:
        """Write the KV of ``req``'s first ``upto`` tokens with an eager step."""
        self.logits(self.step((req, 0, upto)), graphs=False)

    @torch.inference_mode()
    def logits(self, sched: SchedulerOutput, graphs: bool) -> tuple[torch.Tensor, str]:
        runner = self.runner
        saved = runner.graph_runner
        runner.graph_runner = saved if graphs else None
        try:
            hidden, inputs, mode = runner.forward(sched)
            rows = torch.tensor(
                [
                    sum(s.num_new_tokens for s in sched.scheduled[: i + 1]) - 1
                    for i in range(len(sched.scheduled))
                ],
                device=hidden.device,
            )
            out = runner.model.compute_logits(hidden[rows]).float().clone()
        finally:
            runner.graph_runner = saved
        return out, mode


def compare(builder: StepBuilder, sched: SchedulerOutput, expected_mode: str) -> float:
    eager, mode_e = builder.logits(sched, graphs=False)
    graph, mode_g = builder.logits(sched, graphs=True)
    assert mode_e == "eager" and mode_g == expected_mode
    diff = (eager - graph).abs().max().item()
    assert torch.equal(eager.argmax(-1), graph.argmax(-1))
    assert diff <= GRAPH_LOGIT_ATOL, diff
    return diff


def test_graph_replay_logits_equal_eager(llm):
    b = StepBuilder(llm)
    sizes = llm.engine.graph_plan.prefill_capture_sizes
    assert 64 in sizes and 56 in sizes
    diffs = {}
    r = b.request(64)
    diffs["prefill, exact bucket 64"] = compare(b, b.step((r, 0, 64)), "piecewise")
    r = b.request(50)
    diffs["prefill, 50 padded to 56"] = compare(b, b.step((r, 0, 50)), "piecewise")
    r1, r2, r3 = b.request(20), b.request(33), b.request(7)
    diffs["3 prefills, 60 -> 64"] = compare(
        b, b.step((r1, 0, 20), (r2, 0, 33), (r3, 0, 7)), "piecewise"
    )
    a, c = b.request(41), b.request(30)
    b.fill(a, 40)
    diffs["mixed: decode + prefill"] = compare(b, b.step((a, 40, 1), (c, 0, 30)), "piecewise")
    d = b.request(57)
    b.fill(d, 32)
    diffs["chunked-prefill continuation"] = compare(b, b.step((d, 32, 25)), "piecewise")
    e = b.request(65)
    b.fill(e, 64)  # as if 64 tokens (one full block) came from the prefix cache
    diffs["prefix hit + 1 new token"] = compare(b, b.step((e, 64, 1)), "full")
    decs = [b.request(10 + 7 * i) for i in range(5)]
    for q in decs:
        b.fill(q, q.num_prompt_tokens - 1)
    diffs["decode batch 5 -> bucket 8"] = compare(
        b, b.step(*[(q, q.num_prompt_tokens - 1, 1) for q in decs]), "full"
    )
    print("max |logit graph - eager|:", {k: round(v, 5) for k, v in diffs.items()})


@torch.inference_mode()
def test_decode_graph_ends_with_the_logits_and_argmax_of_its_rows(llm):
    """A full decode graph (one GPU: ``capture_logits``) computes its bucket's logits into the
    shared buffer and their argmax; the step samples those instead of launching the LM head and
    the argmax. The logits equal the LM head run eagerly on the graph's hidden rows (up to the
    GEMM's row count), and the argmax is exactly the argmax of those logits, padding included."""
    from custom_ops.argmax_ops import argmax_rows

    b = StepBuilder(llm, seed=3)
    graphs = b.runner.graph_runner
    assert graphs.capture_logits
    decs = [b.request(12 + 5 * i) for i in range(5)]
    for q in decs:
        b.fill(q, q.num_prompt_tokens - 1)
    hidden, inputs, mode = b.runner.forward(
        b.step(*[(q, q.num_prompt_tokens - 1, 1) for q in decs])
    )
    assert mode == "full" and inputs.padded == 8
    logits, argmax = graphs.decode_logits(8)
    assert logits.shape == (8, llm.engine.vocab_size) and logits.dtype == torch.float32
    assert argmax.dtype == torch.int64 and argmax.shape == (8,)
    assert torch.equal(argmax, argmax_rows(logits))
    eager = b.runner.model.compute_logits(hidden[:5]).float()
    diff = (logits[:5].float() - eager).abs().max().item()
    assert diff <= GRAPH_LOGIT_ATOL, diff
    # Every bucket writes its rows of one buffer: no logits buffer per bucket.
    small = graphs.full[min(graphs.full)].tail_output[0]
    assert small.data_ptr() == logits.data_ptr()


@torch.inference_mode()
def test_a_piecewise_step_samples_its_rows_from_the_sampled_row_graph(llm):
    """A mixed step replays its piecewise bucket, then the sampled-row graph of the smallest
    bucket that holds its sampled rows: the logits of those rows (gathered through the
    runner's ``logits_indices``, in that order) into the buffer the decode graphs share, and
    their argmax. They equal the LM head run eagerly on the step's hidden rows (up to the GEMM's
    row count)."""
    from custom_ops.argmax_ops import argmax_rows

    b = StepBuilder(llm, seed=4)
    graphs = b.runner.graph_runner
    assert sorted(graphs.sampled) == sorted(llm.engine.graph_plan.decode_capture_sizes)
    decs = [b.request(15 + 4 * i) for i in range(4)]
    for q in decs:
        b.fill(q, q.num_prompt_tokens - 1)
    new = b.request(37)
    sched = b.step(*[(q, q.num_prompt_tokens - 1, 1) for q in decs], (new, 0, 37))
    hidden, inputs, mode = b.runner.forward(sched)
    assert mode == "piecewise" and len(inputs.sampling_reqs) == 5
    rows = inputs.logits_indices.clone()
    assert rows.tolist() == [0, 1, 2, 3, 40]
    eager = b.runner.model.compute_logits(hidden[rows]).float()
    logits, argmax = graphs.sampled_logits(5)
    bucket = min(s for s in graphs.sampled if s >= 5)
    assert logits.shape == (bucket, llm.engine.vocab_size) and argmax.shape == (bucket,)
    assert torch.equal(argmax, argmax_rows(logits))
    diff = (logits[:5].float() - eager).abs().max().item()
    assert diff <= GRAPH_LOGIT_ATOL, diff
    assert logits.data_ptr() == graphs.decode_logits(max(graphs.full))[0].data_ptr()
    assert graphs.sampled_logits(max(graphs.sampled) + 1) is None


def test_greedy_graphs_on_equal_off_and_transformers(llm, model_dir):
    prompts = random_prompts(4, llm.engine.vocab_size, 8, 300, seed=5)
    before = dict(llm.engine.get_stats()["steps_by_mode"])
    on = greedy(llm, prompts, 32)
    after = llm.engine.get_stats()["steps_by_mode"]
    assert after["full"] > before["full"] and after["piecewise"] > before["piecewise"]
    off_llm = make_llm(
        model_dir, graph_optimization_config={"use_cudagraph": False}, num_gpu_blocks_override=512
    )
    try:
        off = greedy(off_llm, prompts, 32)
        hf = hf_reference(off_llm, model_dir)
    finally:
        off_llm.engine.shutdown()
    same = sum(a == b for a, b in zip(on, off))
    print(f"graphs on vs off: {same}/4 sequences identical")
    assert same == 4
    for p, toks in zip(prompts, on):
        assert_greedy_matches_hf(hf, p, toks)


def test_same_request_twice_same_tokens(llm):
    prompt = random_prompts(1, llm.engine.vocab_size, 100, 100, seed=9)
    assert greedy(llm, prompt, 32) == greedy(llm, prompt, 32)
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=16)
    a = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    b = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert a == b


def test_piecewise_segments_copy_nothing_between_layers(llm):
    """At graph_opt_level 0 with the fused ops a middle segment makes no copy: the merged
    projection writes q/k/v into the shared qkv buffer, flashinfer's RoPE rotates them there,
    and the fused add + RMSNorm updates the residual buffer in place (q, k and v were each
    copied before: 90 copy kernels per 30-layer prefill step)."""
    runner = llm.engine.worker.runner
    segments = runner.graph_runner.piecewise[64].segments
    copied = []
    copy = torch.Tensor.copy_

    def spy(dst, src, *args, **kwargs):
        copied.append(tuple(dst.shape))
        return copy(dst, src, *args, **kwargs)

    with torch.inference_mode():
        runner.buffers.slot_mapping.fill_(-1)  # the segment's K/V write then stores nothing
        torch.Tensor.copy_ = spy
        try:
            for seg in segments[1:-1]:
                seg()
        finally:
            torch.Tensor.copy_ = copy
    assert copied == []


def test_no_capture_outside_warm_up(llm):
    """The capture order of background capture (the default; the offline LLM finishes it before
    its first batch): phase 1 (decode <= 8 requests, prefill <= 512 tokens) before phase 2;
    within a phase decode before prefill, each largest first (capture_order.py)."""
    graphs = llm.engine.worker.runner.graph_runner
    log = [(k, s) for k, s in graphs.capture_log if k in ("prefill", "decode")]
    assert {k for k, _ in log} == {"prefill", "decode"}

    def phase(kind, size):
        return 1 if size <= (8 if kind == "decode" else 512) else 2

    phases = [phase(k, s) for k, s in log]
    assert phases == sorted(phases)
    for p in (1, 2):
        part = [(k, s) for (k, s), ph in zip(log, phases) if ph == p]
        kinds = [k for k, _ in part]
        assert kinds == sorted(kinds, key=lambda k: k != "decode")  # decode first, then prefill
        for kind in ("prefill", "decode"):
            sizes = [s for k, s in part if k == kind]
            assert sizes == sorted(sizes, reverse=True)
    with pytest.raises(RuntimeError, match="outside the capture window"):
        graphs.capture_full_decode(1, None, None, None, None)


def test_engine_create_destroy_create(model_dir):
    prompts = random_prompts(2, 49152, 10, 40, seed=11)
    first = make_llm(
        model_dir,
        graph_optimization_config=GRAPHS,
        num_gpu_blocks_override=256,
        max_num_seqs=4,
        max_num_batched_tokens=128,
    )
    out1 = greedy(first, prompts, 8)
    first.engine.shutdown()
    del first
    second = make_llm(
        model_dir,
        graph_optimization_config=GRAPHS,
        num_gpu_blocks_override=256,
        max_num_seqs=4,
        max_num_batched_tokens=128,
    )
    try:
        assert greedy(second, prompts, 8) == out1
    finally:
        second.engine.shutdown()
