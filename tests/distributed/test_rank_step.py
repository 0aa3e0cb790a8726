"""What rank 0 sends the other ranks each step: ``rank_step`` fills the input buffers exactly as
the full step does, without the requests' history, sampling state or detokenizer."""

from __future__ import annotations

import pickle

import pytest
import torch

from fastdeploy.core.request import Request
from fastdeploy.core.sampling_params import SamplingParams
from fastdeploy.core.scheduler_output import ScheduledRequest, SchedulerOutput
from fastdeploy.worker.gpu_model_runner import GPUModelRunner
from fastdeploy.worker.input_batch import InputBuffers, RankRequest, rank_step
from fastdeploy.worker.worker_process import RankCall, ranks_per_node


def request(rid: str, prompt: list[int], output: list[int], blocks: list[int]) -> Request:
    r = Request(rid, prompt, SamplingParams(temperature=0))
    r.output_token_ids = output
    r.block_ids = blocks
    r.detokenizer = object()  # stands for the engine's state that must not travel
    return r


def step() -> SchedulerOutput:
    """A decode (history in prompt and output), a chunk that ends mid-prompt, a last chunk that
    reaches into the output (a resumed request) and a fresh prefill."""
    decode = request("decode", list(range(10, 30)), [7, 8, 9], [3, 4])
    mid = request("mid", list(range(40)), [], [5, 6, 7])
    resumed = request("resumed", list(range(50, 70)), [1, 2, 3, 4], [8, 9])
    fresh = request("fresh", [5, 6, 7], [], [10])
    sched = SchedulerOutput(
        scheduled=[
            ScheduledRequest(decode, 22, 1),
            ScheduledRequest(mid, 16, 16),
            ScheduledRequest(resumed, 16, 8),
            ScheduledRequest(fresh, 0, 3),
        ],
        finished_request_ids=["gone"],
    )
    sched.preempted.append(request("preempted", [1], [], []))
    return sched


@pytest.mark.parametrize("padded", [None, 40])
def test_rank_step_fills_the_buffers_as_the_full_step(padded):
    def prepare(s):
        buffers = InputBuffers(64, 8, 4, 16, torch.device("cpu"))
        return buffers.prepare(s, padded=padded)

    full, sent = step(), rank_step(step())
    a, b = prepare(full), prepare(sent)
    for name in ("input_ids", "positions", "logits_indices"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    for name in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
        assert torch.equal(getattr(a.batch, name), getattr(b.batch, name)), name
    assert a.sampling_reqs == b.sampling_reqs == ["decode", "resumed", "fresh"]
    assert (a.num_tokens, a.padded) == (b.num_tokens, b.padded)
    assert sent.finished_request_ids == [] and sent.preempted == []
    assert all(isinstance(s.request, RankRequest) for s in sent.scheduled)
    # the message carries no engine-side Request (history, sampling state, detokenizer) and
    # only this step's tokens
    message = pickle.dumps(RankCall("execute_model", (sent, ("eager", None))))
    assert b"fastdeploy.core.request" not in message
    assert sent.scheduled[0].request.step_token_ids == [9]  # token 22 of 23


def test_a_step_dispatched_to_a_graph_this_rank_lacks_is_an_error():
    """Rank 0 decides the mode; a rank without that graph refuses instead of running eagerly
    (the ranks would otherwise disagree on what they run)."""
    runner = GPUModelRunner.__new__(GPUModelRunner)
    runner.graph_runner = None
    with pytest.raises(RuntimeError, match="dispatched to a piecewise graph"):
        runner.forward(step(), ("piecewise", 64))


def test_rank_calls_and_sizes_are_checked():
    with pytest.raises(ValueError, match="method='sample' is invalid; allowed: load_model"):
        RankCall("sample")
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide by nnodes=2"):
        ranks_per_node(3, 2)
    assert ranks_per_node(4, 2) == 2
