"""Serving while CUDA graphs are captured (issue #47), on CPU with the default model.

No CUDA graph can be captured here, so :class:`SlowGraphs` stands in for ``CudaGraphRunner``: its
capture of a bucket checks that the dummy step the runner prepared writes its K/V into the null
block only (block 0, never a live request's), runs the model once on it, eagerly (as a capture's
warm-up does), sleeps, and raises
for the buckets a test names; its replay runs the model eagerly on the padded inputs (what a replay
computes) and checks that the bucket was fully captured. The engine's worker then captures through
``GpuWorker.capture_next_graph``, between steps, as on the GPU.
"""

from __future__ import annotations

import queue
import threading
import time

import pytest
import torch

from fastdeploy import LLM, SamplingParams
from fastdeploy.config.plan import GraphPlan
from fastdeploy.core.messages import EngineStats, StopLoop
from fastdeploy.engine.engine_loop import EngineLoop
from fastdeploy.model_executor.forward_meta import ForwardMeta
from fastdeploy.model_executor.graph_optimization.capture_order import GapPacer

pytestmark = pytest.mark.slow  # loads the default model

#: Prefill buckets: 512, 64 and 16 in the first phase, 1024 in the second; decode 8, 4, 2, 1.
PLAN = GraphPlan(
    decode_graphs=True,
    prefill_graphs=True,
    decode_capture_sizes=[8, 4, 2, 1],
    prefill_capture_sizes=[1024, 512, 64, 16],
)
CAPTURE_S = 0.05  # the stand-in's capture time per bucket


class SlowGraphs:
    """A ``CudaGraphRunner`` stand-in that captures slowly (module docstring)."""

    capture_logits = False

    def __init__(self, runner, plan: GraphPlan, fail: set[tuple[str, int]] = frozenset()):
        self.runner, self.plan, self.fail = runner, plan, set(fail)
        self.stored: dict[tuple[str, int], bool] = {}
        self.building: tuple[str, int] | None = None
        self.captures: list[tuple[str, int]] = []
        self.replays: list[tuple[str, int]] = []
        self.window = False
        self.phases = 0
        self.capture_seconds = 0.0

    def begin_capture(self):
        self.window = True

    def end_capture(self):
        self.window = False

    def begin_phase(self):
        self.phases += 1

    def _capture(self, key, input_ids, meta):
        assert self.window, "captured outside the capture window"
        # The dummy step writes its K/V into the null block only, never a live request's.
        slots = meta.slot_mapping[: input_ids.numel()]
        blocks = set((slots[slots >= 0] // self.runner.buffers.block_size).tolist())
        assert blocks == {0}, f"{key} capture writes into blocks {blocks}"
        self.building = key
        self.captures.append(key)
        if input_ids.numel() <= 64:  # the warm-up run, writing its K/V (the large buckets
            # would only cost CPU time: they write into the same null block)
            positions = self.runner.buffers.positions[: input_ids.numel()]
            self.runner.model(input_ids, positions, meta)
        time.sleep(CAPTURE_S)
        if key in self.fail:
            self.building = None
            raise torch.OutOfMemoryError(f"stand-in: no memory for {key[0]} bucket {key[1]}")
        self.stored[key] = True
        self.building = None

    def capture_piecewise(self, num_tokens, input_ids, positions, forward_meta):
        self._capture(("prefill", num_tokens), input_ids, forward_meta)

    def capture_full_decode(self, batch_size, input_ids, positions, batch, forward_meta):
        backend = self.runner.attn_backend
        meta = ForwardMeta(
            backend,
            backend.build_metadata(batch),
            self.runner.kv_caches,
            slot_mapping=forward_meta.slot_mapping,
        )
        self._capture(("decode", batch_size), input_ids, meta)

    def _replay(self, key, input_ids, meta):
        assert self.building is None and self.stored.get(key), f"replay of {key} half-built"
        self.replays.append(key)
        positions = self.runner.buffers.positions[: input_ids.numel()]
        return self.runner.model(input_ids, positions, meta)

    def replay_full(self, bucket, input_ids, batch):
        backend = self.runner.attn_backend
        meta = ForwardMeta(backend, backend.build_metadata(batch), self.runner.kv_caches)
        return self._replay(("decode", bucket), input_ids, meta)

    def replay_piecewise(self, bucket, input_ids, forward_meta):
        return self._replay(("prefill", bucket), input_ids, forward_meta)

    def decode_logits(self, bucket):
        return None

    def sampled_logits(self, num_rows):
        return None

    def discard(self, kind, size):
        self.stored.pop((kind, size), None)

    def release(self):
        self.stored.clear()


@pytest.fixture(scope="module")
def llm():
    try:
        return LLM(
            max_model_len=512,
            max_num_seqs=8,
            max_num_batched_tokens=1024,
            block_size=16,
            num_gpu_blocks_override=300,
            seed=0,
        )
    except FileNotFoundError as e:
        pytest.skip(str(e))


PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Who wrote Hamlet?",
]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def generate(llm, prompts=PROMPTS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def record_steps(runner, progress) -> list[dict]:
    """Wrap ``runner.dispatch``: per step, the plan's choice, the dispatched one and the ready
    buckets at that step."""
    steps: list[dict] = []
    dispatch = runner.dispatch

    def recording(sched):
        got = dispatch(sched)
        planned = runner.graph_runner.plan.dispatch(
            sched.is_decode_only, len(sched.scheduled), sched.num_batched_tokens
        )
        steps.append(
            {"planned": planned, "got": got, "ready": dict(progress.ready), "done": progress.done}
        )
        return got

    runner.dispatch = recording
    return steps


@pytest.fixture(scope="module")
def eager(llm) -> list[list[int]]:
    """The prompts' greedy tokens with no graphs at all."""
    assert llm.engine.worker.runner.graph_runner is None
    return generate(llm)


@pytest.fixture
def background(llm, eager):
    """Start a background capture with a :class:`SlowGraphs` (decode bucket 2 fails); yields
    ``(engine, graphs, progress)`` and removes the graphs afterwards."""
    engine = llm.engine
    worker, runner = engine.worker, engine.worker.runner
    graphs = SlowGraphs(runner, PLAN, fail={("decode", 2)})
    worker.start_background_capture(graphs)
    pacer = engine.capture_pacer
    engine.capture_pacer = GapPacer(1.0)  # busy or not, one graph in every gap: deterministic
    try:
        yield engine, graphs, worker.capture_progress
    finally:
        engine.capture_pacer = pacer
        runner.graph_runner = runner.capture_progress = worker.capture_progress = None
        runner.__dict__.pop("dispatch", None)


def test_requests_are_served_while_buckets_switch_one_by_one(llm, eager, background):
    engine, graphs, progress = background
    runner = engine.worker.runner
    steps = record_steps(runner, progress)
    during = generate(llm)
    assert during == eager  # greedy output equal while buckets switch
    # Served during capture: steps ran, eagerly and replaying, before the capture was over.
    serving = [s for s in steps if not s["done"]]
    assert any(s["got"][0] == "eager" for s in serving)
    assert any(s["got"][0] != "eager" for s in serving)
    assert len(graphs.captures) <= len(steps)  # at most one graph per gap

    # Idle: the rest is captured (the engine loop does this between commands).
    while engine.graph_capture_pending():
        engine.capture_next_graph()
    assert graphs.captures == [
        ("decode", 8), ("decode", 4), ("decode", 2), ("decode", 1),
        ("prefill", 512), ("prefill", 64), ("prefill", 16),
        ("prefill", 1024),
    ]  # fmt: skip
    assert graphs.phases == 2 and not graphs.window  # the second phase began; window closed
    after = generate(llm, PROMPTS + PROMPTS[:1])  # 5 requests: decode bucket 8
    two = generate(llm, PROMPTS[:2])  # 2 requests: decode bucket 2, whose capture failed
    assert after[:4] == eager and two == eager[:2]

    # The ready buckets grew monotonically, one at a time, and each step replayed a bucket
    # only when it was ready, else ran eagerly.
    for a, b in zip(steps, steps[1:]):
        assert all(a["ready"][k] <= b["ready"][k] for k in a["ready"])
        assert sum(len(b["ready"][k]) - len(a["ready"][k]) for k in a["ready"]) <= 1
    kinds = {"piecewise": "prefill", "full": "decode"}
    for s in steps:
        mode, bucket = s["planned"]
        ready = mode in kinds and bucket in s["ready"][kinds[mode]]
        assert s["got"] == (s["planned"] if ready else ("eager", None)), s
    replayed = [s for s in steps if s["got"][0] != "eager"]
    assert any(s["got"][0] == "eager" for s in steps[:3])  # eager before its bucket is in
    assert replayed  # and replays once it is
    assert ("decode", 2) not in graphs.replays
    two_req = [s for s in steps if s["planned"] == ("full", 2)]
    assert two_req and all(s["got"] == ("eager", None) for s in two_req)  # failed: eager

    stats = engine.get_stats()["graph_capture"]
    assert stats["done"] and stats["background"]
    assert (stats["captured"], stats["failed"], stats["total"]) == (7, 1, 8)
    assert stats["failures"] == [
        {"kind": "decode", "size": 2, "reason": "OutOfMemoryError: stand-in: no memory for "
         "decode bucket 2"}
    ]  # fmt: skip
    assert stats["by_kind"] == {"prefill": [4, 4], "decode": [3, 4]}


def test_an_idle_engine_loop_captures_without_waiting_for_commands(llm, eager):
    """The loop captures one graph per turn while idle (no 0.5 s wait for a command between
    them) and emits the progress after each."""
    engine = llm.engine
    worker, runner = engine.worker, engine.worker.runner
    graphs = SlowGraphs(runner, PLAN)
    worker.start_background_capture(graphs)
    commands: queue.SimpleQueue = queue.SimpleQueue()
    sent: list = []

    def emit(msg):
        sent.append(msg)
        if isinstance(msg, EngineStats) and msg.stats["graph_capture"]["done"]:
            commands.put(StopLoop())

    loop = threading.Thread(target=EngineLoop(engine, commands, emit).run, daemon=True)
    start = time.monotonic()
    try:
        loop.start()
        loop.join(timeout=60)
        elapsed = time.monotonic() - start
        assert not loop.is_alive()
        captured = [m.stats["graph_capture"]["captured"] for m in sent[1:]]
        assert captured == list(range(1, 9))  # one graph a turn, each reported
        assert elapsed < 8 * CAPTURE_S + 2.0  # far below 8 idle waits of 0.5 s on top
    finally:
        commands.put(StopLoop())
        loop.join(timeout=10)
        runner.graph_runner = runner.capture_progress = worker.capture_progress = None


def test_a_bucket_another_rank_failed_is_dropped_here_too(llm, eager, monkeypatch):
    """Tensor parallelism: the ranks agree on each capture (the minimum of a success flag); a
    rank that captured a bucket another rank failed drops its graph, so no rank replays it.
    The other rank is simulated by the agreement's answer."""
    import fastdeploy.worker.gpu_worker as gpu_worker

    engine = llm.engine
    worker, runner = engine.worker, engine.worker.runner
    one = GraphPlan(True, False, [4], [])
    graphs = SlowGraphs(runner, one)
    worker.start_background_capture(graphs)
    asked = []

    def other_rank_failed(value, tp):
        asked.append(value)
        return 0

    monkeypatch.setattr(gpu_worker, "min_over_ranks", other_rank_failed)
    try:
        done = engine.capture_next_graph()
        assert asked == [1] and done["ok"] is False  # captured here, refused by the group
        assert graphs.captures == [("decode", 4)] and ("decode", 4) not in graphs.stored
        stats = engine.get_stats()["graph_capture"]
        assert stats["failures"] == [
            {
                "kind": "decode",
                "size": 4,
                "reason": "capture failed on another tensor-parallel rank",
            }
        ]
        assert generate(llm) == eager and graphs.replays == []  # bucket 4 stays eager
    finally:
        runner.graph_runner = runner.capture_progress = worker.capture_progress = None
