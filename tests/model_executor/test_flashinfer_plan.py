"""PrefillPlanner on CPU, with a stand-in for flashinfer's prefill wrapper: which plans go through
the wrapper's plan(), and what a direct plan passes to the compiled scheduler and sets on the
wrapper. That the direct plan equals flashinfer's own (same schedule, same output) is checked on
a GPU (tests/gpu/test_attention_gpu.py::test_direct_prefill_plan_equals_flashinfers_plan)."""

import pytest
import torch

from fastdeploy.model_executor.layers.attention.flashinfer_plan import (
    DIRECT_VERSIONS,
    PrefillPlanner,
    direct_plan_supported,
)
from fastdeploy.model_executor.layers.attention.flashinfer_staging import PrefillArrays

VERSION = DIRECT_VERSIONS[0]
SHAPE = (9, 3, 64, 16)  # heads, KV heads, head size, page size
STATIC = dict(causal=True, sm_scale=0.125, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)


class FakeModule:
    """The compiled module: records ``plan`` calls, returns a distinct plan each time."""

    def __init__(self):
        self.calls = []

    def plan(self, *args):
        self.calls.append(args)
        return [100 + len(self.calls)]


class FakeWrapper:
    """The attributes of flashinfer 0.5.3's prefill wrapper that the direct plan reads."""

    is_cuda_graph_enabled = False

    def __init__(self, backend="fa2"):
        self._backend = backend
        self._jit_module = None
        self._cached_module = FakeModule()
        self._float_workspace_buffer = torch.zeros(8)
        self._int_workspace_buffer = torch.zeros(8)
        self._pin_memory_int_workspace_buffer = torch.zeros(8)
        self._custom_mask_buf = None
        self._prefix_len_ptr = None
        self._max_total_num_rows = None
        self._qo_indptr_buf = self._paged_kv_indptr_buf = None
        self._paged_kv_indices_buf = self._paged_kv_last_page_len_buf = None
        self._plan_info = None
        self.plans = []

    def plan(self, *args, **kwargs):
        self.plans.append((args, kwargs))
        self._plan_info = ["from plan()"]


def arrays(query_lens, seq_lens, page_size=16):
    """The arrays of a step (device arrays on the CPU here)."""
    pages = [-(-s // page_size) for s in seq_lens]
    qo = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    kv = torch.tensor([0, *torch.tensor(pages).cumsum(0).tolist()], dtype=torch.int32)
    last = torch.tensor(
        [s - (p - 1) * page_size for s, p in zip(seq_lens, pages)], dtype=torch.int32
    )
    ids = torch.arange(1, sum(pages) + 1, dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return PrefillArrays(qo, kv, last, lens, qo.clone(), kv.clone(), last.clone(), ids)


def plan(planner, query_lens, seq_lens, **static):
    a = arrays(query_lens, seq_lens)
    planner.plan(a, sum(query_lens), max(query_lens), max(seq_lens), *SHAPE, **(static or STATIC))
    return a


def test_first_plan_through_plan_then_direct():
    w = FakeWrapper()
    planner = PrefillPlanner(w, VERSION)
    first = plan(planner, [16], [16])
    # plan() gets the host arrays (device ones would make it copy them back and wait)
    ((args, kwargs),) = w.plans
    assert args[0] is first.qo_indptr and args[1] is first.kv_indptr
    assert args[2] is first.page_ids_dev and args[3] is first.last_page_len
    assert args[4:] == SHAPE and kwargs == dict(STATIC, seq_lens=first.seq_lens)
    assert planner.direct_plans == 0 and w._cached_module.calls == []

    second = plan(planner, [37, 13, 1], [37, 33, 34])
    assert len(w.plans) == 1 and planner.direct_plans == 1
    (call,) = w._cached_module.calls
    hq, hkv, d, page = SHAPE
    assert call[:3] == (
        w._float_workspace_buffer, w._int_workspace_buffer, w._pin_memory_int_workspace_buffer,
    )  # fmt: skip
    assert call[3] is second.qo_indptr and call[4] is second.kv_indptr
    assert call[5] is second.seq_lens
    # total rows, batch, heads, KV heads, page, graph mode, head sizes, causal, window,
    # fixed split size, split-KV off, co-located CTAs: what 0.5.3's plan() passes for fa2
    assert call[6:] == (51, 3, hq, hkv, page, False, d, d, True, -1, -1, False, 0)
    assert w._plan_info == [101]
    assert (w._batch_size, w._max_q_len, w._max_kv_len) == (3, 37, 37)
    assert w._qo_indptr_buf is second.qo_indptr_dev
    assert w._paged_kv_indptr_buf is second.kv_indptr_dev
    assert w._paged_kv_indices_buf is second.page_ids_dev
    assert w._paged_kv_last_page_len_buf is second.last_page_len_dev
    assert w._seq_lens_kv is second.seq_lens and w._seq_lens_q is second.seq_lens


def test_other_static_arguments_plan_through_plan_again():
    w = FakeWrapper()
    planner = PrefillPlanner(w, VERSION)
    plan(planner, [4], [4])
    plan(planner, [4], [8])
    plan(planner, [4], [8], **dict(STATIC, sm_scale=0.5))
    assert len(w.plans) == 2 and planner.direct_plans == 1
    plan(planner, [4], [8], **dict(STATIC, sm_scale=0.5))
    assert len(w.plans) == 2 and planner.direct_plans == 2
    planner.plan(arrays([4], [8]), 4, 4, 8, 9, 3, 128, 16, **STATIC)  # another head size
    assert len(w.plans) == 3 and planner.direct_plans == 2


@pytest.mark.parametrize(
    "change",
    [
        lambda w: setattr(w, "_backend", "fa3"),
        lambda w: setattr(w, "_jit_module", object()),
        lambda w: setattr(w, "is_cuda_graph_enabled", True),
        lambda w: setattr(w, "_custom_mask_buf", torch.zeros(1)),
        lambda w: setattr(w, "_max_total_num_rows", 64),
        lambda w: delattr(w, "_pin_memory_int_workspace_buffer"),
        lambda w: setattr(w, "_cached_module", None),
    ],
    ids=["fa3", "jit-variant", "cuda-graph", "custom-mask", "graph-rows", "attribute", "module"],
)
def test_wrappers_it_was_not_written_for_always_plan_through_plan(change):
    w = FakeWrapper()
    change(w)
    assert not direct_plan_supported(w, VERSION)
    planner = PrefillPlanner(w, VERSION)
    for _ in range(3):
        plan(planner, [16], [16])
    assert len(w.plans) == 3 and planner.direct_plans == 0


def test_other_flashinfer_versions_always_plan_through_plan():
    w = FakeWrapper()
    assert direct_plan_supported(w, VERSION)
    planner = PrefillPlanner(w, "0.6.0")
    for _ in range(3):
        plan(planner, [16], [16])
    assert len(w.plans) == 3 and planner.direct_plans == 0


@pytest.mark.parametrize(
    "extra",
    [
        {"window_left": 32},
        {"head_dim_vo": 128},
        {"fixed_split_size": 4},
        {"disable_split_kv": True},
    ],  # fmt: skip
    ids=["window", "head-dim-vo", "fixed-split", "no-split"],
)
def test_keywords_the_direct_plan_does_not_pass_keep_every_plan_on_plan(extra):
    """The direct call passes their defaults: a plan with one of them never goes direct."""
    w = FakeWrapper()
    planner = PrefillPlanner(w, VERSION)
    for _ in range(3):
        plan(planner, [16], [16], **dict(STATIC, **extra))
    assert len(w.plans) == 3 and planner.direct_plans == 0
    assert all(kwargs.items() >= extra.items() for _, kwargs in w.plans)
