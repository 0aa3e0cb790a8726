"""The start-up heap is frozen out of full garbage collections once an engine has started, given
back at shutdown, left alone with FD_GC_FREEZE=0, and a bad value fails before the model loads."""

from __future__ import annotations

import gc
import json
import weakref

import pytest
from tiny_models import tiny_llama

from fastdeploy import LLM
from fastdeploy.core import gc_heap
from fastdeploy.core.gc_heap import freeze_startup_heap, unfreeze_heap


class Node:
    """A cyclic object that only the collector can free."""

    def __init__(self) -> None:
        self.me = self


@pytest.fixture(autouse=True)
def freeze_on(monkeypatch):
    monkeypatch.setenv("FD_GC_FREEZE", "1")
    gc.unfreeze()
    yield
    gc.unfreeze()
    gc_heap._frozen_here = False


@pytest.fixture
def tiny_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny_llama(num_hidden_layers=1)))
    return str(tmp_path)


def tiny_llm(tiny_dir) -> LLM:
    return LLM(tiny_dir, load_format="dummy", skip_tokenizer_init=True, max_model_len=64, seed=0)


def test_freeze_moves_live_objects_out_and_frees_earlier_frozen_garbage():
    node = Node()
    ref = weakref.ref(node)
    gc.freeze()  # as an earlier engine's start-up left it
    del node
    gc.collect()
    assert ref() is not None  # frozen: a full collection does not see the dead cycle
    frozen = freeze_startup_heap("test")
    assert ref() is None  # unfrozen and collected before freezing again
    assert frozen == gc.get_freeze_count() > 1000  # the interpreter's and pytest's objects
    assert unfreeze_heap() is True
    assert gc.get_freeze_count() == 0
    assert unfreeze_heap() is False  # nothing of this module's left to undo


def test_keep_frozen_collects_only_what_came_after_the_first_freeze():
    early = Node()
    early_ref = weakref.ref(early)
    freeze_startup_heap("test")  # the API server's early freeze, while its engine loads
    del early  # a cycle frozen alive: it stays until an unfreeze
    late = Node()
    late_ref = weakref.ref(late)
    del late  # garbage allocated after the first freeze
    first = gc.get_freeze_count()
    frozen = freeze_startup_heap("test", keep_frozen=True)
    assert late_ref() is None  # the new garbage was collected
    assert early_ref() is not None  # the earlier freeze was kept (no full unfreeze + collect)
    assert frozen >= first
    freeze_startup_heap("test")  # without keep_frozen: unfreeze, collect everything
    assert early_ref() is None
    unfreeze_heap()


def test_off_switch_leaves_an_applications_own_freeze_alone(monkeypatch, tiny_dir):
    monkeypatch.setenv("FD_GC_FREEZE", "0")
    assert freeze_startup_heap("test", enabled=False) == 0
    assert gc.get_freeze_count() == 0
    gc.freeze()  # the application's
    before = gc.get_freeze_count()
    llm = tiny_llm(tiny_dir)
    assert gc.get_freeze_count() > before // 2  # not unfrozen (some frozen objects died since)
    llm.engine.shutdown()
    assert gc.get_freeze_count() > before // 2


def test_bad_value_fails_before_the_model_loads(monkeypatch, tiny_dir):
    monkeypatch.setenv("FD_GC_FREEZE", "sometimes")
    from fastdeploy.worker import gpu_worker

    loads = []
    monkeypatch.setattr(gpu_worker.GpuWorker, "load_model", lambda self: loads.append(1))
    with pytest.raises(ValueError, match="FD_GC_FREEZE='sometimes' is invalid"):
        tiny_llm(tiny_dir)
    assert loads == []


def test_engine_freezes_after_start_and_gives_back_at_shutdown(tiny_dir):
    llm = tiny_llm(tiny_dir)
    model = weakref.ref(llm.engine.worker.runner.model)
    assert gc.get_freeze_count() > 1000
    llm.engine.shutdown()
    assert gc.get_freeze_count() == 0
    del llm
    gc.collect()
    assert model() is None  # nothing frozen keeps the model alive


def test_a_new_engine_frees_one_dropped_without_shutdown(monkeypatch, tiny_dir):
    from fastdeploy.worker import gpu_worker

    sizing = gpu_worker.GpuWorker.determine_num_blocks
    alive_when_sizing = []

    def determine_num_blocks(self):
        alive_when_sizing.append(model is not None and model() is not None)
        return sizing(self)

    monkeypatch.setattr(gpu_worker.GpuWorker, "determine_num_blocks", determine_num_blocks)
    model = None
    first = tiny_llm(tiny_dir)
    holder = Node()  # a cycle through the frozen LLM object: only the collector frees it
    holder.llm, first.holder = first, holder
    model = weakref.ref(first.engine.worker.runner.model)
    del first, holder
    gc.collect()
    assert model() is not None  # frozen: gc.collect() does not free the cycle
    second = tiny_llm(tiny_dir)
    # the second: the first engine was freed before the new one sized its KV cache
    assert alive_when_sizing == [False, False]
    second.engine.shutdown()


@pytest.mark.slow
def test_server_with_a_bad_value_exits_2_before_the_model_loads(tmp_path):
    import os
    import subprocess
    import sys

    env = {**os.environ, "FD_GC_FREEZE": "maybe"}
    out = subprocess.run(
        [sys.executable, "-m", "fastdeploy.entrypoints.openai.api_server", "--device", "cpu",
         "--model", str(tmp_path / "no-such-model")],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert out.returncode == 2
    assert "FD_GC_FREEZE='maybe' is invalid" in out.stderr  # not the missing model
