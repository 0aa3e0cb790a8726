"""The runner's side of the overlap schedule and of the sync-free step, on CPU: sampled tokens
come back through :class:`OutputStager` (log-probabilities packed into the same rows), and a
request whose last token is still on the device gets it from the previous step's sampled tokens
(a device gather and scatter), never from the host."""

from __future__ import annotations

import pytest
import torch

from fastdeploy.core.request import Request
from fastdeploy.core.sampling_params import SamplingParams
from fastdeploy.core.scheduler_output import ScheduledRequest, SchedulerOutput
from fastdeploy.model_executor.layers.sampler import SamplerOutput
from fastdeploy.worker.async_output import OutputStager, PendingOutput, SampledToken
from fastdeploy.worker.input_batch import InputBuffers, LastSampled

CPU = torch.device("cpu")


def test_tokens_and_packed_logprobs_come_back_as_sampled_tokens():
    stager = OutputStager(4, CPU)
    plain = stager.stage(SamplerOutput(token_ids=torch.tensor([5, 9])), ["a", "b"])
    assert plain.result() == {"a": SampledToken(5), "b": SampledToken(9)}
    assert plain.done and plain.result() is plain.result()
    out = SamplerOutput(
        token_ids=torch.tensor([3, 4]),
        logprobs=torch.tensor([-0.5, -1.25]),
        top_ids=torch.tensor([[3, 7], [4, 1]]),
        top_logprobs=torch.tensor([[-0.5, -2.0], [-1.25, -3.5]]),
    )
    got = stager.stage(out, ["a", "b"]).result()
    assert got["a"] == SampledToken(3, -0.5, [(3, -0.5), (7, -2.0)])
    assert got["b"] == SampledToken(4, -1.25, [(4, -1.25), (1, -3.5)])
    no_top = SamplerOutput(token_ids=torch.tensor([8]), logprobs=torch.tensor([-0.75]))
    assert stager.stage(no_top, ["c"]).result() == {"c": SampledToken(8, -0.75, None)}
    assert PendingOutput.ready({}).result() == {}
    with pytest.raises(ValueError, match="exceed max_num_reqs=4"):
        stager.stage(SamplerOutput(token_ids=torch.zeros(5, dtype=torch.int64)), list("abcde"))


def test_token_ids_agree_with_result_with_and_without_logprobs():
    """token_ids() is result()'s token ids, whichever is read first, and reading it frees the
    host buffer (done) as result() does."""
    stager = OutputStager(4, CPU)
    plain = stager.stage(SamplerOutput(token_ids=torch.tensor([5, 9])), ["a", "b"])
    assert not plain.done
    assert plain.token_ids() == {"a": 5, "b": 9} and plain.done
    assert plain.result() == {"a": SampledToken(5), "b": SampledToken(9)}
    assert plain.token_ids() is plain.token_ids()
    out = SamplerOutput(
        token_ids=torch.tensor([3]),
        logprobs=torch.tensor([-0.5]),
        top_ids=torch.tensor([[3]]),
        top_logprobs=torch.tensor([[-0.5]]),
    )
    packed = stager.stage(out, ["a"])
    assert packed.token_ids() == {"a": 3}
    assert packed.result() == {"a": SampledToken(3, -0.5, [(3, -0.5)])}
    ready = PendingOutput.ready({"x": SampledToken(2, -0.1)})
    assert ready.token_ids() == {"x": 2} and ready.result()["x"].logprob == -0.1


def decode_step(request: Request) -> SchedulerOutput:
    return SchedulerOutput(scheduled=[ScheduledRequest(request, request.num_tokens - 1, 1)])


def test_a_placeholder_row_takes_the_previous_steps_token_on_the_device():
    buffers = InputBuffers(32, 4, 4, 16, CPU)
    known = Request("known", [11, 12, 13], SamplingParams(), output_token_ids=[21])
    pending = Request("pending", [31, 32, 33], SamplingParams(), output_token_ids=[41])
    for r in (known, pending):
        r.block_ids = [1]
    # ``pending`` sampled a token in the step in flight: its next row is that token's KV.
    pending.num_computed_tokens = pending.num_tokens
    pending.num_output_placeholders = 1
    sched = SchedulerOutput(
        scheduled=[
            ScheduledRequest(known, known.num_tokens - 1, 1),
            ScheduledRequest(pending, pending.num_tokens, 1),
        ]
    )
    last = LastSampled(torch.tensor([77, 55]), {"other": 0, "pending": 1})
    inputs = buffers.prepare(sched, padded=4, last_sampled=last)
    assert inputs.num_fed == 1 and inputs.sampling_reqs == ["known", "pending"]
    assert inputs.input_ids.tolist() == [21, 55, 0, 0]
    assert inputs.positions.tolist() == [3, 4, 0, 0]
    assert inputs.logits_indices.tolist() == [0, 1]
    with pytest.raises(RuntimeError, match="'pending' needs 1 token id that the host"):
        buffers.prepare(sched)  # no previous step's tokens to take it from
    plain = buffers.prepare(decode_step(known))
    assert plain.num_fed == 0 and plain.input_ids.tolist() == [21]
