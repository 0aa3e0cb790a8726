"""The plan calls the flashinfer backend makes through a wrapper's ``plan()`` (eager decode,
eager prefill with and without PrefillPlanner, graph decode with and without GraphDecodePlanner)
bind to the signature of flashinfer-python 0.5.3's ``plan`` (parameter names and order as in
that release's ``flashinfer/decode.py`` and ``flashinfer/prefill.py``), on CPU, with stand-in
wrappers.

Why on CPU: eager decode steps, the prefill plan when the direct plan is refused and graph decode
plans through ``plan()`` otherwise run only on a GPU, where a wrong argument list surfaced as
``plan() missing 1 required positional argument: 'page_size'`` at the engine's first step
(the refactor 2bc4a66 had ``build_metadata`` pass a layout object where the three arrays go)."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fastdeploy.model_executor.layers.attention import flashinfer_backend
from fastdeploy.model_executor.layers.attention.backend import AttentionBackend, AttentionBatch
from fastdeploy.model_executor.layers.attention.flashinfer_backend import (
    FlashInferAttentionBackend,
)
from fastdeploy.model_executor.layers.attention.flashinfer_graph_decode import GraphDecode
from fastdeploy.model_executor.layers.attention.flashinfer_plan import PrefillPlanner
from fastdeploy.model_executor.layers.attention.flashinfer_staging import PlanStaging

CPU = torch.device("cpu")
HEADS, KV_HEADS, HEAD_DIM, PAGE = 9, 3, 64, 16


class DecodeWrapper:
    """``BatchDecodeWithPagedKVCacheWrapper`` of flashinfer 0.5.3: its constructor's keywords
    and its ``plan`` signature."""

    def __init__(self, workspace, layout="NHD", use_cuda_graph=False, use_tensor_cores=False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None,
                 paged_kv_last_page_len_buffer=None, backend="auto", jit_args=None):  # fmt: skip
        self.plans = []

    def reset_workspace_buffer(self, float_workspace, int_workspace, pinned_int=None):
        pass

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
             page_size, pos_encoding_mode="NONE", window_left=-1, logits_soft_cap=None,
             q_data_type="float16", kv_data_type=None, data_type=None, sm_scale=None,
             rope_scale=None, rope_theta=None, non_blocking=True, block_tables=None,
             seq_lens=None, fixed_split_size=None, disable_split_kv=False):  # fmt: skip
        self.plans.append(
            dict(indptr=indptr.tolist(), indices=indices.tolist(), last=last_page_len.tolist(),
                 shape=(num_qo_heads, num_kv_heads, head_dim, page_size),
                 q_data_type=q_data_type, kv_data_type=kv_data_type, sm_scale=sm_scale)
        )  # fmt: skip


class PrefillWrapper:
    """``BatchPrefillWithPagedKVCacheWrapper.plan`` of flashinfer 0.5.3 (its signature)."""

    def __init__(self):
        self.plans = []

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
             num_qo_heads, num_kv_heads, head_dim_qk, page_size, head_dim_vo=None,
             custom_mask=None, packed_custom_mask=None, causal=False, pos_encoding_mode="NONE",
             use_fp16_qk_reduction=False, sm_scale=None, window_left=-1, logits_soft_cap=None,
             rope_scale=None, rope_theta=None, q_data_type="float16", kv_data_type=None,
             non_blocking=True, prefix_len_ptr=None, token_pos_in_items_ptr=None,
             token_pos_in_items_len=0, max_item_len_ptr=None, seq_lens=None, seq_lens_q=None,
             block_tables=None, max_token_per_sequence=None, max_sequence_kv=None,
             fixed_split_size=None, disable_split_kv=False):  # fmt: skip
        self.plans.append(
            dict(qo_indptr=qo_indptr.tolist(), indptr=paged_kv_indptr.tolist(),
                 indices=paged_kv_indices.tolist(), causal=causal,
                 shape=(num_qo_heads, num_kv_heads, head_dim_qk, page_size))
        )  # fmt: skip


class Event:
    def synchronize(self):
        pass


@pytest.fixture
def backend(monkeypatch):
    """A backend built without a GPU: the attributes ``__init__`` sets, with the stand-ins; a
    flashinfer version the direct plans were not written for, so every plan goes through
    ``plan()``."""
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(flashinfer_backend, "record_event", lambda event: None)
    b = object.__new__(FlashInferAttentionBackend)
    AttentionBackend.__init__(b, HEADS, KV_HEADS, HEAD_DIM, PAGE, torch.bfloat16, CPU)
    b._flashinfer = SimpleNamespace(
        __version__="0.0.0", BatchDecodeWithPagedKVCacheWrapper=DecodeWrapper
    )
    b.max_num_reqs, b.max_num_blocks, b.use_tensor_cores = 4, 32, False
    b.workspace = b._int_workspace = torch.zeros(8, dtype=torch.uint8)
    b.prefill_wrapper, b.decode_wrapper = PrefillWrapper(), DecodeWrapper(b.workspace)
    b._plan_events = {}
    b._staging = PlanStaging(b.max_num_reqs, b.max_num_blocks, CPU)
    b._prefill_planner = None
    b.graph_decode = graph_decode_of(b)
    return b


def graph_decode_of(b: FlashInferAttentionBackend) -> GraphDecode:
    """The decode-graph part over the fixture's stand-ins (as the backend's ``__init__`` builds
    it)."""
    return GraphDecode(
        b._flashinfer, b.workspace, b._int_workspace, b.use_tensor_cores, b.max_num_reqs,
        b.max_num_blocks, b.block_size, CPU, b._staging,
    )  # fmt: skip


def batch(query_lens, seq_lens, slot_mapping=None):
    """A step of ``len(query_lens)`` requests; request ``i`` holds blocks ``10 * (i + 1) + j``;
    ``slot_mapping`` the persistent buffer of a graph's (its rows are the padded tokens)."""
    n = len(query_lens)
    table = np.array([[10 * (i + 1) + j for j in range(4)] for i in range(n)], np.int32)
    if slot_mapping is None:
        slot_mapping = torch.zeros(sum(query_lens), dtype=torch.int64)
    return AttentionBatch(
        num_reqs=n, num_tokens=sum(query_lens),
        query_start_loc=torch.tensor(np.cumsum([0, *query_lens]), dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=torch.from_numpy(table),
        slot_mapping=slot_mapping, max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), is_decode_only=all(q == 1 for q in query_lens),
        query_lens_host=list(query_lens), seq_lens_host=list(seq_lens), block_tables_host=table,
    )  # fmt: skip


def test_an_eager_decode_step_plans_the_decode_wrapper(backend):
    md = backend.build_metadata(batch([1, 1], [17, 3]))
    assert md.wrapper is backend.decode_wrapper
    (plan,) = backend.decode_wrapper.plans
    assert plan["indptr"] == [0, 2, 3] and plan["indices"] == [10, 11, 20]
    assert plan["last"] == [1, 3] and plan["shape"] == (HEADS, KV_HEADS, HEAD_DIM, PAGE)
    assert plan["q_data_type"] == plan["kv_data_type"] == torch.bfloat16
    assert plan["sm_scale"] == HEAD_DIM**-0.5


def test_a_mixed_step_plans_the_prefill_wrapper(backend):
    md = backend.build_metadata(batch([5, 1], [21, 4]))
    assert md.wrapper is backend.prefill_wrapper
    (plan,) = backend.prefill_wrapper.plans
    assert plan["qo_indptr"] == [0, 5, 6] and plan["indptr"] == [0, 2, 3]
    assert plan["indices"] == [10, 11, 20] and plan["causal"] is True


def test_a_mixed_step_through_the_prefill_planner_binds(backend):
    """The default GPU path of a mixed step: PrefillPlanner, which plans through ``plan()``
    where its direct plan is refused (here: an unknown flashinfer version)."""
    backend._prefill_planner = PrefillPlanner(backend.prefill_wrapper, "0.0.0")
    staging = backend._staging  # take the pinned path (a CPU stand-in for the device buffer)
    staging._packed_dev = torch.zeros(staging._sets.capacity("packed"), dtype=torch.int32)
    md = backend.build_metadata(batch([5, 1], [21, 4]))
    assert md.wrapper is backend.prefill_wrapper
    (plan,) = backend.prefill_wrapper.plans
    assert plan["qo_indptr"] == [0, 5, 6] and plan["indptr"] == [0, 2, 3]
    assert plan["causal"] is True and plan["shape"] == (HEADS, KV_HEADS, HEAD_DIM, PAGE)


@pytest.mark.parametrize("direct", ["1", "0"])
def test_graph_decode_plans_through_plan_bind(backend, monkeypatch, direct):
    """Through GraphDecodePlanner (refusing an unknown version) and, with
    ``FD_FLASHINFER_DIRECT_PLAN=0``, without it."""
    monkeypatch.setenv("FD_FLASHINFER_DIRECT_PLAN", direct)
    backend.graph_decode = graph_decode_of(backend)
    assert (backend.graph_decode.planner is None) == (direct == "0")
    md = backend.make_graph_decode_metadata(4)
    slots = torch.zeros(4, dtype=torch.int64)
    for seq_lens in ([17, 3], [33, 3], [40, 3, 2]):  # new pages each step: no kept plan
        backend.plan_graph_decode(md, batch([1] * len(seq_lens), seq_lens, slots), 4)
    plans = md.wrapper.plans
    assert [p["indptr"] for p in plans] == [[0, 2, 3, 3, 3], [0, 3, 4, 4, 4], [0, 3, 4, 5, 5]]
    assert plans[2]["indices"] == [10, 11, 12, 20, 30]
    assert plans[2]["last"] == [8, 3, 2, 1]  # padding: 1, as paged_kv_layout gives it
    assert plans[2]["shape"] == (HEADS, KV_HEADS, HEAD_DIM, PAGE)
