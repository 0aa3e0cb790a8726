"""The start-up heap is frozen out of full garbage collections once an engine has started, given
back at shutdown, and not frozen with FD_GC_FREEZE=0."""

from __future__ import annotations

import gc
import json
import weakref

import pytest
from tiny_models import tiny_llama

from fastdeploy import LLM
from fastdeploy.engine.gc_heap import freeze_startup_heap, unfreeze_heap


class Node:
    """A cyclic object that only the collector can free."""

    def __init__(self) -> None:
        self.me = self


@pytest.fixture(autouse=True)
def unfrozen():
    gc.unfreeze()
    yield
    gc.unfreeze()


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
    unfreeze_heap()
    assert gc.get_freeze_count() == 0


def test_off_switch_and_bad_value(monkeypatch):
    monkeypatch.setenv("FD_GC_FREEZE", "0")
    assert freeze_startup_heap("test") == 0
    assert gc.get_freeze_count() == 0
    monkeypatch.setenv("FD_GC_FREEZE", "sometimes")
    with pytest.raises(ValueError, match="FD_GC_FREEZE='sometimes' is invalid"):
        freeze_startup_heap("test")


def test_engine_freezes_after_start_and_gives_back_at_shutdown(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny_llama(num_hidden_layers=1)))
    llm = LLM(
        str(tmp_path), load_format="dummy", skip_tokenizer_init=True, max_model_len=64, seed=0
    )
    model = weakref.ref(llm.engine.worker.runner.model)
    assert gc.get_freeze_count() > 1000
    llm.engine.shutdown()
    assert gc.get_freeze_count() == 0
    del llm
    gc.collect()
    assert model() is None  # nothing frozen keeps the model alive
