"""No host sync in the step (issue 13, item 2), with the overlap schedule on and off, CUDA graphs
on and off: prefill, mixed and decode steps run under ``torch.cuda.set_sync_debug_mode("error")``
(any implicit sync raises: ``.item()``, ``.tolist()`` of a device tensor, a blocking copy, a
stream or device synchronize), and every ``Event.synchronize`` is classified: the one wait per
step on the sampled tokens' event is allowed; the pinned staging buffers' events must never
block; others (the attention backend guarding its own plan buffer) are reported.

Also: greedy and seeded tokens are equal with the overlap schedule on and off (no request ends
early, so both see the same batches).

Run on a CUDA host: ``python -m pytest -q -m gpu tests/gpu/test_no_host_sync_gpu.py``.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
from gpu_utils import make_llm, preset_dir, random_prompts

from fastdeploy import SamplingParams
from fastdeploy.worker.async_output import OutputStager

GRAPHS = {
    "graphs": {"use_cudagraph": True, "full_cuda_graph": False},
    "eager": {"use_cudagraph": False},
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return preset_dir(tmp_path_factory, "smollm2-135m")


def params_mix(max_tokens: int) -> list[SamplingParams]:
    """Greedy, seeded with penalties and top-k/top-p, logprobs, min_tokens with stop ids, and
    logit_bias: every sampling path and every lazily allocated buffer."""
    return [
        SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=7, top_k=50, top_p=0.9, max_tokens=max_tokens,
                       ignore_eos=True, frequency_penalty=0.3, repetition_penalty=1.1),
        SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=5),
        SamplingParams(temperature=0.7, seed=8, max_tokens=max_tokens, min_tokens=4,
                       stop_token_ids=[17], presence_penalty=0.2, logprobs=0),
        SamplingParams(temperature=1.0, seed=9, max_tokens=max_tokens, ignore_eos=True,
                       logit_bias={42: 2.0}),
    ]  # fmt: skip


class SyncWatch:
    """Counts ``torch.cuda.Event.synchronize`` calls by owner while :meth:`watching`."""

    def __init__(self, engine, monkeypatch) -> None:
        runner = engine.worker.runner
        self.staging = [*runner.buffers.staging_sets, runner.sampling._staging]
        self.sampled: list = []  # the sampled tokens' events (kept alive: ids stay unique)
        self.sampled_waits = 0
        self.other_waits = 0
        self.other_blocking = 0
        self.active = False
        stage, synchronize = OutputStager.stage, torch.cuda.Event.synchronize
        watch = self

        def staged(stager, out, request_ids):
            pending = stage(stager, out, request_ids)
            watch.sampled.append(pending._event)
            return pending

        def synchronized(event):
            if watch.active:
                watch.classify(event)
            return synchronize(event)

        monkeypatch.setattr(OutputStager, "stage", staged)
        monkeypatch.setattr(torch.cuda.Event, "synchronize", synchronized)

    def classify(self, event) -> None:
        if any(event is e for e in self.sampled[-4:]):
            self.sampled_waits += 1
            return
        staging_events = [e for s in self.staging for e in s._events if e is not None]
        if any(event is e for e in staging_events):
            raise AssertionError("the host waited for a pinned staging buffer's copies")
        self.other_waits += 1
        self.other_blocking += not event.query()

    @contextmanager
    def watching(self):
        self.active = True
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield self
        finally:
            torch.cuda.set_sync_debug_mode("default")
            self.active = False


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
@pytest.mark.parametrize("graphs", list(GRAPHS))
def test_prefill_mixed_and_decode_steps_wait_only_for_the_sampled_tokens(
    model_dir, monkeypatch, graphs, overlap
):
    llm = make_llm(
        model_dir,
        graph_optimization_config=GRAPHS[graphs],
        disable_overlap_schedule=not overlap,
        num_gpu_blocks_override=256,
        max_num_seqs=8,
        max_num_batched_tokens=256,
    )
    try:
        engine = llm.engine
        assert engine.overlap_schedule == overlap
        # Warm-up outside the watch: kernels load, lazy buffers and pinned blocks are allocated.
        warm = random_prompts(5, engine.vocab_size, 20, 90, seed=1)
        llm.generate(warm, params_mix(12), use_tqdm=False)
        watch = SyncWatch(engine, monkeypatch)
        prompts = random_prompts(5, engine.vocab_size, 20, 300, seed=2)  # some chunked
        for i, (p, sp) in enumerate(zip(prompts, params_mix(24))):
            engine.add_request(f"r{i}", p, sp)
        emitted: dict[str, list[int]] = {}
        steps = 0
        with watch.watching():
            while engine.has_unfinished_requests():
                before = watch.sampled_waits
                for out in engine.step():
                    emitted.setdefault(out.request_id, []).extend(out.new_token_ids)
                assert watch.sampled_waits - before <= 1  # one wait per step at most
                steps += 1
        engine.check_integrity()
        assert sorted(emitted) == [f"r{i}" for i in range(5)]
        assert watch.sampled_waits > 0
        modes = engine.get_stats()["steps_by_mode"]
        print(f"{graphs}/{'overlap' if overlap else 'serial'}: {steps} steps {modes}, sampled "
              f"waits {watch.sampled_waits}, other event waits {watch.other_waits} "
              f"({watch.other_blocking} blocking)")  # fmt: skip
        if graphs == "graphs":
            assert modes["full"] > 0 and modes["piecewise"] > 0
    finally:
        llm.engine.shutdown()


def test_greedy_and_seeded_tokens_equal_with_overlap_on_and_off(model_dir):
    prompts = random_prompts(6, 49152, 10, 200, seed=3)
    params = [
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=21, max_tokens=33, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=22, top_k=40, max_tokens=47, ignore_eos=True,
                       frequency_penalty=0.4),
    ] * 2  # fmt: skip
    results = []
    for overlap in (True, False):
        llm = make_llm(
            model_dir,
            graph_optimization_config=GRAPHS["graphs"],
            disable_overlap_schedule=not overlap,
            num_gpu_blocks_override=256,
        )
        try:
            outs = llm.generate(prompts, params, use_tqdm=False)
            results.append([o.outputs[0].token_ids for o in outs])
            llm.engine.check_integrity()
        finally:
            llm.engine.shutdown()
    assert results[0] == results[1]
