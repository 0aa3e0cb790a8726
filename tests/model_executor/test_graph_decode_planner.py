"""GraphDecodePlanner and PlanStaging.stage_graph_decode on CPU, with a stand-in for flashinfer's
CUDA-graph decode wrapper: where the staged arrays land in the graphs' fixed buffers, which plans
go through the wrapper's plan() and what a direct plan passes to the compiled scheduler. That the
direct plan equals flashinfer's own (schedule, fixed buffers, output) is checked on a GPU
(tests/gpu/test_graph_decode_gpu.py::test_direct_graph_decode_plan_equals_flashinfers_plan)."""

import gc

import numpy as np
import torch

from fastdeploy.model_executor.layers.attention.flashinfer_layout import paged_kv_layout
from fastdeploy.model_executor.layers.attention.flashinfer_plan import (
    DIRECT_VERSIONS,
    GraphDecodePlanner,
)
from fastdeploy.model_executor.layers.attention.flashinfer_staging import PlanStaging

CPU = torch.device("cpu")
SHAPE = (9, 3, 64, 16)  # heads, KV heads, head size, page size
DTYPES = dict(q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, sm_scale=0.125)


def pinned_staging(max_reqs: int, max_blocks: int) -> PlanStaging:
    staging = PlanStaging(max_reqs, max_blocks, CPU)
    # Take the pinned path on a CPU host (a stand-in device buffer; only its presence matters).
    staging._packed_dev = torch.zeros(1, dtype=torch.int32)
    return staging


def test_staged_arrays_land_where_each_bucket_reads_them():
    r, p = 5, 40
    staging = pinned_staging(r, p)
    fixed = torch.full((PlanStaging.graph_decode_size(r, p),), -7, dtype=torch.int32)
    for bucket, seq_lens in ((4, [5, 17, 33]), (2, [1, 40]), (5, [3, 3, 3, 3, 3])):
        table = np.arange(100, 100 + bucket * 10, dtype=np.int32).reshape(bucket, 10)
        layout = paged_kv_layout([1] * len(seq_lens), seq_lens, 4, 10, bucket - len(seq_lens))
        ids = table.reshape(-1)[np.asarray(layout.page_rows)].astype(np.int32)
        arrays = staging.stage_graph_decode(layout, ids, fixed)
        staging.queued()
        # The views make_graph_decode_metadata gives a bucket's wrapper.
        assert torch.equal(fixed[: bucket + 1], layout.kv_indptr)
        assert torch.equal(fixed[r + 1 : r + 1 + bucket], layout.kv_last_page_len)
        assert fixed[2 * r + 1 : 2 * r + 1 + len(ids)].tolist() == ids.tolist()
        assert torch.equal(arrays.kv_indptr, layout.kv_indptr)
        assert torch.equal(arrays.last_page_len, layout.kv_last_page_len)
        assert arrays.page_ids.tolist() == ids.tolist()
    too_many = paged_kv_layout([1], [4 * (p + 1)], 4, p + 1)
    assert staging.stage_graph_decode(too_many, np.zeros(p + 1, np.int32), fixed) is None
    assert staging.stage_graph_decode(too_many, None, fixed) is None


class FakeModule:
    def __init__(self):
        self.calls = []

    def plan(self, *args):
        self.calls.append(args)
        return [200 + len(self.calls)]


class FakeGraphWrapper:
    """The attributes of flashinfer 0.5.3's CUDA-graph decode wrapper the direct plan reads;
    ``plan`` sets the module and plan info as flashinfer's does."""

    is_cuda_graph_enabled = True
    use_tensor_cores = False

    def __init__(self, batch_size: int):
        self._backend = "auto"
        self._jit_module = None
        self._fixed_batch_size = batch_size
        self._float_workspace_buffer = torch.zeros(8)
        self._int_workspace_buffer = torch.zeros(8)
        self._pin_memory_int_workspace_buffer = torch.zeros(8)
        self._paged_kv_indptr_buf = self._paged_kv_indices_buf = None
        self._paged_kv_last_page_len_buf = None
        self.plans = []

    def plan(self, indptr, indices, last_page_len, *args, **kwargs):
        self.plans.append((indices.device, args, kwargs))
        self._cached_module = FakeModule()
        self._plan_info = ["from plan()"]
        self._batch_size = len(last_page_len)


def staged_arrays(bucket: int = 2):
    staging = pinned_staging(4, 16)
    fixed = torch.zeros(PlanStaging.graph_decode_size(4, 16), dtype=torch.int32)
    layout = paged_kv_layout([1], [20], 16, 4, bucket - 1)
    return staging.stage_graph_decode(layout, np.array([7, 9], np.int32), fixed)


def test_first_plan_through_plan_then_the_compiled_scheduler_with_plans_arguments():
    planner = GraphDecodePlanner(DIRECT_VERSIONS[0], CPU)
    wrapper = FakeGraphWrapper(2)
    arrays = staged_arrays()
    planner.plan(wrapper, arrays, *SHAPE, **DTYPES)
    assert len(wrapper.plans) == 1 and planner.direct_plans == 0
    assert wrapper.plans[0][2] == DTYPES
    planner.plan(wrapper, arrays, *SHAPE, **DTYPES)
    assert len(wrapper.plans) == 1 and planner.direct_plans == 1
    (call,) = wrapper._cached_module.calls
    assert call[3] is arrays.kv_indptr  # the host kv_indptr, as plan() passes it
    assert call[4:13] == (2, 9, 3, 16, True, -1, 0.0, 64, 64)
    assert call[13].dtype == call[14].dtype == torch.bfloat16 and call[13].numel() == 0
    assert wrapper._plan_info == [201] and wrapper._batch_size == 2
    planner.plan(wrapper, arrays, *SHAPE, **{**DTYPES, "sm_scale": 0.5})  # another shape
    assert len(wrapper.plans) == 2 and planner.direct_plans == 1


def test_refused_wrappers_always_plan_through_plan_with_device_page_ids():
    arrays = staged_arrays()
    # A version the direct plan was not written for; "meta" stands in for the CUDA device.
    other = GraphDecodePlanner("0.0.0", torch.device("meta"))
    wrapper = FakeGraphWrapper(2)
    for _ in range(3):
        other.plan(wrapper, arrays, *SHAPE, **DTYPES)
    assert len(wrapper.plans) == 3 and other.direct_plans == 0
    # Host ids would make flashinfer's plan() copy them with a blocking copy.
    assert all(device.type == "meta" for device, _, _ in wrapper.plans)
    tensor_cores = FakeGraphWrapper(2)
    tensor_cores.use_tensor_cores = True
    planner = GraphDecodePlanner(DIRECT_VERSIONS[0], CPU)
    for _ in range(2):
        planner.plan(tensor_cores, arrays, *SHAPE, **DTYPES)
    assert len(tensor_cores.plans) == 2 and planner.direct_plans == 0


def test_a_new_wrapper_plans_through_plan_first_even_at_a_recycled_address():
    planner = GraphDecodePlanner(DIRECT_VERSIONS[0], CPU)
    arrays = staged_arrays()
    wrapper = FakeGraphWrapper(2)
    planner.plan(wrapper, arrays, *SHAPE, **DTYPES)
    del wrapper
    gc.collect()
    for _ in range(50):  # wrappers made now often reuse the freed one's id
        fresh = FakeGraphWrapper(2)
        planner.plan(fresh, arrays, *SHAPE, **DTYPES)
        assert len(fresh.plans) == 1 and planner.direct_plans == 0
