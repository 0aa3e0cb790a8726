"""The engine end to end on CPU with a tiny random-weight Llama (float32, exact comparisons):
batching, chunked prefill and preemption give the same tokens; seeds reproduce; bad input is
rejected without disturbing the engine."""

from __future__ import annotations

import json

import pytest
import torch
from support import record_preemptions
from tiny_models import tiny_llama

from fastdeploy import LLM, SamplingParams
from fastdeploy.core.request import Request
from fastdeploy.model_executor.graph_optimization.piecewise import (
    PiecewiseGraph,
    SegmentBuffers,
    make_segments,
)
from fastdeploy.worker.input_batch import dummy_step

TINY = tiny_llama(num_hidden_layers=3)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_llama")
    (d / "config.json").write_text(json.dumps(TINY))
    return str(d)


def tiny_llm(tiny_dir, **kw) -> LLM:
    args = dict(
        load_format="dummy",
        skip_tokenizer_init=True,
        max_model_len=256,
        block_size=16,
        max_num_seqs=8,
        seed=0,
    )
    args.update(kw)
    return LLM(tiny_dir, **args)


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return tiny_llm(tiny_dir)


def prompts(n=6, lo=3, hi=90, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(3, 512, (k,), generator=g).tolist() for k in lens]


GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def tokens(llm, ps, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)]


def test_batch_equals_each_prompt_alone(llm):
    ps = prompts()
    alone = [tokens(llm, [p])[0] for p in ps]
    assert tokens(llm, ps) == alone
    assert all(len(t) == 20 for t in alone)


def test_chunked_prefill_equals_unchunked(llm, tiny_dir):
    ps = prompts(seed=1)
    chunked = tiny_llm(tiny_dir, max_num_batched_tokens=16)
    steps = []
    original = chunked.engine.scheduler.schedule

    def spy():
        out = original()
        steps.append([s.num_new_tokens for s in out.scheduled])
        return out

    chunked.engine.scheduler.schedule = spy
    assert tokens(chunked, ps) == tokens(llm, ps)
    assert max(sum(s) for s in steps) <= 16
    assert any(len(s) > 1 and max(s) > 1 for s in steps)  # prefill chunks mixed with decodes


def test_preemption_by_recompute_gives_same_tokens(llm, tiny_dir):
    ps = prompts(n=6, lo=40, hi=60, seed=2)
    small = tiny_llm(tiny_dir, num_gpu_blocks_override=12)  # 11 usable blocks of 16 tokens
    preempted = record_preemptions(small.engine)
    assert tokens(small, ps) == tokens(llm, ps)
    assert preempted, "the pool was large enough: no preemption happened"
    stats = small.engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_seeded_sampling_is_reproducible(llm):
    ps = prompts(n=4, seed=3)
    params = SamplingParams(
        temperature=1.0, top_p=0.9, top_k=40, seed=1234, max_tokens=16, ignore_eos=True
    )
    first = tokens(llm, ps, params)
    assert tokens(llm, ps[::-1], params)[::-1] == first  # independent of the batch
    assert tokens(llm, ps[:1], params)[0] == first[0]
    other = SamplingParams(temperature=1.0, seed=99, max_tokens=16, ignore_eos=True)
    assert tokens(llm, ps, other) != first


def test_logprobs_and_stop_token_ids(llm):
    p = prompts(n=1, seed=4)
    greedy = tokens(llm, p)[0]
    out = llm.generate(
        p, SamplingParams(temperature=0, max_tokens=5, logprobs=3, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert out.token_ids == greedy[:5]
    for entry, tok in zip(out.logprobs, out.token_ids):
        assert entry["token_id"] == tok and entry["logprob"] <= 0
        assert entry["top_logprobs"][0][0] == tok  # greedy picks the most likely token
        assert len(entry["top_logprobs"]) == 3
    stop = SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[greedy[3]], ignore_eos=True)
    out = llm.generate(p, stop, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == greedy[: greedy.index(greedy[3]) + 1]
    assert out.finish_reason == "stop"


def test_max_model_len_stops_generation(llm):
    p = [list(range(3, 250))]  # 247 tokens, max_model_len 256
    out = llm.generate(
        p, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert len(out.token_ids) == 256 - 247 and out.finish_reason == "length"


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: SamplingParams(max_tokens=0), "max_tokens=0"),
        (lambda: SamplingParams(temperature=-1), "temperature=-1"),
        (lambda: SamplingParams(top_p=0), "top_p=0"),
        (lambda: SamplingParams(top_p=1.5), "top_p=1.5"),
        (lambda: SamplingParams.from_dict({"temprature": 1}), "temprature.*temperature"),
    ],
)
def test_bad_sampling_params(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_bad_prompts_are_rejected_and_engine_keeps_serving(llm):
    with pytest.raises(ValueError, match="300 tokens, but max_model_len is 256"):
        llm.generate([[5] * 300], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[5, 100000]], GREEDY, use_tqdm=False)
    # A batch with one bad prompt queues nothing; the engine serves the next call normally.
    with pytest.raises(ValueError):
        llm.generate([[5, 6, 7], [5] * 300], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    stats = llm.engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert len(tokens(llm, [[5, 6, 7]])[0]) == 20


def test_engine_and_scheduler_share_one_length_rule(llm):
    """A prompt of max_model_len tokens leaves no room for output: check_request and the
    scheduler refuse it with the same message; one token fewer goes through both."""
    engine, n = llm.engine, llm.engine.max_model_len
    with pytest.raises(ValueError, match=f"{n} tokens, but max_model_len is {n}") as front:
        engine.check_request([5] * n)
    with pytest.raises(ValueError) as back:
        engine.scheduler.add_request(Request("direct", [5] * n, GREEDY))
    assert str(back.value) == f"request 'direct': {front.value}"
    engine.check_request([5] * (n - 1))
    out = llm.generate([[5] * (n - 1)], GREEDY, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"
    assert not engine.has_unfinished_requests()


def test_bad_model_and_engine_args(tmp_path):
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        LLM(str(tmp_path / "does-not-exist"))
    (tmp_path / "config.json").write_text(
        json.dumps({**TINY, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    )
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        LLM(str(tmp_path), load_format="dummy")
    with pytest.raises(ValueError, match="max_num_seq"):
        LLM(str(tmp_path), max_num_seq=4)


def piecewise_setup(llm, merged_qkv: bool = True):
    """A 40-token step of 3 requests padded to a 48-token bucket: (meta, the model's own hidden
    states for the real rows, the bucket's segments, their buffers; ``merged_qkv`` as the graph
    runner sets it: True at graph_opt_level 0, False under torch.compile)."""
    runner = llm.engine.worker.runner
    backend = runner.attn_backend
    sched = dummy_step([20, 7, 13], 16)
    inputs = runner.buffers.prepare(sched, padded=48)
    meta = runner.build_forward_meta(inputs)
    expected = runner.model(inputs.input_ids, inputs.positions, meta)[:40].clone()
    bufs = SegmentBuffers(
        64,
        64,
        backend.num_heads * backend.head_dim,
        backend.num_kv_heads * backend.head_dim,
        backend.dtype,
        backend.device,
        merged_qkv=merged_qkv,
    )
    segments = make_segments(runner.model, bufs, inputs.input_ids, inputs.positions)
    return meta, expected, segments, bufs


def run_segments(llm, segments, bufs, meta) -> torch.Tensor:
    layers = llm.engine.worker.runner.model.layers
    return PiecewiseGraph(48, segments, bufs, [layer.attn for layer in layers]).run_eager(meta)[:40]


def test_piecewise_segments_compose_to_the_model_forward(llm):
    """On CPU no graph is captured, but the segments a bucket would capture must compute the
    same hidden states as the model's own forward (padding rows excluded)."""
    with torch.inference_mode():
        meta, expected, segments, bufs = piecewise_setup(llm)
        got = run_segments(llm, segments, bufs, meta)
    assert len(segments) == TINY["num_hidden_layers"] + 1
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_segments_write_q_k_v_in_place_through_the_merged_buffer(llm):
    """At graph_opt_level 0 the merged QKV projection writes straight into the segments' qkv
    buffer: q, k and v are its column views, v is never copied, and the buffers hold what
    the model's own projection, RoPE included, computes for the last layer."""
    runner = llm.engine.worker.runner
    with torch.inference_mode():
        meta, _, segments, bufs = piecewise_setup(llm)
        assert bufs.q.data_ptr() == bufs.qkv.data_ptr()
        assert bufs.k.stride() == bufs.qkv.stride()
        layers = runner.model.layers
        graph = PiecewiseGraph(48, segments, bufs, [la.attn for la in layers])
        copied_to = []
        copy = torch.Tensor.copy_

        def spy(dst, src, *args, **kwargs):
            copied_to.append(dst.data_ptr())
            return copy(dst, src, *args, **kwargs)

        torch.Tensor.copy_ = spy
        try:
            graph.run_eager(meta)
        finally:
            torch.Tensor.copy_ = copy
        # v is never copied; q and k are here only because the CPU's reference RoPE returns
        # new tensors (flashinfer's, on CUDA, rotates them in place: no copy at all).
        assert copied_to and bufs.v.data_ptr() not in copied_to
        # Recompute the last layer's pre-attention on its own from the residual stream.
        h = runner.model.embed(runner.buffers.input_ids[:48])
        res = None
        for i, layer in enumerate(layers):
            q, k, v, res = layer.pre_attention(runner.buffers.positions[:48], h, res)
            if i == len(layers) - 1:
                break
            attn = runner.attn_backend.forward(q, k, v, runner.kv_caches[i], meta.attn_metadata)
            h, res = layer.post_attention(attn, res)
    for got, want in ((bufs.q, q), (bufs.k, k), (bufs.v, v)):
        torch.testing.assert_close(got[:40], want[:40], rtol=0, atol=1e-6)


def test_segments_that_write_the_kv_cache_compose_to_the_model_forward(llm):
    """The graph_opt_level 0 layout: each segment writes its layer's K/V (the attention between
    segments only attends). Same hidden states as the model's forward, and the same KV cache
    contents as the model's own write."""
    runner = llm.engine.worker.runner
    layers = runner.model.layers
    with torch.inference_mode():
        caches = [runner.kv_caches[layer.attn.layer_idx] for layer in layers]
        for c in caches:  # earlier tests' KV would mask what this step writes
            c.zero_()
        meta, expected, _, bufs = piecewise_setup(llm)
        written = [c.clone() for c in caches]
        for c in caches:
            c.zero_()
        inputs_ids, positions = runner.buffers.input_ids[:48], runner.buffers.positions[:48]
        slots = meta.attn_metadata.slot_mapping
        kv_stores = [(c, slots) for c in caches]
        segments = make_segments(runner.model, bufs, inputs_ids, positions, kv_stores)
        graph = PiecewiseGraph(48, segments, bufs, [la.attn for la in layers], kv_in_segments=True)
        got = graph.run_eager(meta)[:40]
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    for before, after in zip(written, caches):
        torch.testing.assert_close(after, before, rtol=0, atol=0)


@pytest.mark.slow  # torch.compile starts its compile workers in processes
def test_compiled_segments_match_eager_and_all_compile(llm):
    """graph_opt_level 1 on CPU: every segment is compiled by Inductor (none silently left eager
    by dynamo's recompile limit, here set to 1 to force the issue) and the composition equals
    the model's forward. Capture itself needs CUDA; see tests/gpu."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from fastdeploy.model_executor.graph_optimization.piecewise import compile_segments

    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=1), torch.inference_mode():
        meta, expected, segments, bufs = piecewise_setup(llm, merged_qkv=False)
        before = counters["stats"]["unique_graphs"]
        got = run_segments(llm, compile_segments(segments, graph_opt_level=1), bufs, meta)
        assert counters["stats"]["unique_graphs"] - before == len(segments)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert compile_segments(segments, graph_opt_level=0) is segments
