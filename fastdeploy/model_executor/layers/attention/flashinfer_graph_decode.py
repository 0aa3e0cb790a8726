"""The flashinfer backend's decode CUDA graphs: their fixed metadata buffers, one wrapper per
bucket, and the plan before each replay (:class:`GraphDecode`, owned by
:class:`~fastdeploy.model_executor.layers.attention.flashinfer_backend.FlashInferAttentionBackend`,
which hands it what it needs).

Every bucket's wrapper reads the same fixed buffers (``kv_indptr``, ``kv_last_page_len``, the page
ids), packed in one device buffer
(:meth:`~fastdeploy.model_executor.layers.attention.flashinfer_staging.PlanStaging.graph_decode_size`)
so that a plan made without flashinfer's Python ``plan``
(:class:`~fastdeploy.model_executor.layers.attention.flashinfer_plan.GraphDecodePlanner`) fills
them with one copy; a replay always follows the plan of its own bucket, which rewrites them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fastdeploy import envs
from fastdeploy.model_executor.layers.attention.backend import AttentionBatch
from fastdeploy.model_executor.layers.attention.flashinfer_layout import (
    FlashInferMetadata,
    paged_kv_layout,
)
from fastdeploy.model_executor.layers.attention.flashinfer_plan import GraphDecodePlanner
from fastdeploy.model_executor.layers.attention.flashinfer_staging import (
    PlanStaging,
    host_page_ids,
)

#: ``plan_decode(wrapper, *arrays, plan_fn=None)``: the backend's decode plan (it waits for the
#: wrapper's previous plan and adds the attention shape and dtypes).
PlanDecode = Callable[..., None]


class GraphDecode:
    """The decode-graph part of the flashinfer backend: the fixed buffers every bucket's graph
    reads, the direct planner and the key of the last plan.

    Args:
        flashinfer: the flashinfer module (its decode wrapper class and version).
        workspace: the backend's float workspace (shared by every wrapper).
        int_workspace: the int workspace shared by the bucket wrappers (uint8, device).
        use_tensor_cores: whether decode runs flashinfer's tensor-core kernel.
        max_num_reqs: the largest bucket.
        max_num_blocks: capacity of the fixed page-index buffer.
        block_size: tokens per KV block.
        device: the CUDA device of the buffers.
        staging: the backend's :class:`PlanStaging` (pinned host arrays, one copy per plan).

    Attributes:
        planner: plans without flashinfer's Python ``plan`` where that is safe
            (:class:`GraphDecodePlanner`; ``FD_FLASHINFER_DIRECT_PLAN``, CUDA-core path only),
            else None.
    """

    def __init__(
        self,
        flashinfer: Any,
        workspace: torch.Tensor,
        int_workspace: torch.Tensor,
        use_tensor_cores: bool,
        max_num_reqs: int,
        max_num_blocks: int,
        block_size: int,
        device: torch.device,
        staging: PlanStaging,
    ) -> None:
        self._flashinfer = flashinfer
        self.workspace = workspace
        self._int_workspace = int_workspace
        self.use_tensor_cores = use_tensor_cores
        self.max_num_reqs = max_num_reqs
        self.max_num_blocks = max_num_blocks
        self.block_size = block_size
        self._staging = staging
        r = max_num_reqs
        self._graph_fixed = torch.zeros(
            PlanStaging.graph_decode_size(r, max_num_blocks), dtype=torch.int32, device=device
        )
        self._graph_kv_indptr = self._graph_fixed[: r + 1]
        self._graph_kv_last_page_len = self._graph_fixed[r + 1 : 2 * r + 1]
        self._graph_kv_last_page_len.fill_(1)
        self._graph_kv_indices = self._graph_fixed[2 * r + 1 :]
        self.planner = (
            GraphDecodePlanner(getattr(flashinfer, "__version__", ""), device)
            if envs.FD_FLASHINFER_DIRECT_PLAN() and not use_tensor_cores
            else None
        )
        # (wrapper, kv_indptr bytes, page id bytes) of the last graph decode plan; see plan().
        self._graph_plan_key: tuple | None = None

    def forget_plan(self) -> None:
        """The next plan of any bucket goes through in full (its graphs were released)."""
        self._graph_plan_key = None

    def make_metadata(self, batch_size: int) -> FlashInferMetadata:
        """Prepare for capture: a CUDA-graph decode wrapper for a bucket of ``batch_size``
        requests, bound to the backend's fixed metadata buffers (call outside stream capture).

        Capture protocol, per bucket ``B`` (largest first):

        1. ``meta = make_metadata(B)``;
        2. ``plan(meta, dummy_batch, B, plan_decode)`` with a decode step padded to ``B`` tokens
           whose ``slot_mapping`` is the runner's persistent buffer (its address is recorded);
        3. at least one eager forward with ``meta`` (warm-up: compiles the flashinfer and Triton
           kernels and lets flashinfer allocate its small constant buffers outside capture);
        4. capture the forward with ``meta`` as ``attn_metadata``.

        Raises:
            ValueError: ``batch_size`` outside ``1..max_num_reqs``.
        """
        if not 1 <= batch_size <= self.max_num_reqs:
            raise ValueError(
                f"decode bucket {batch_size} outside 1..max_num_reqs={self.max_num_reqs}"
            )
        wrapper = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace,
            "NHD",
            use_cuda_graph=True,
            use_tensor_cores=self.use_tensor_cores,
            paged_kv_indptr_buffer=self._graph_kv_indptr[: batch_size + 1],
            paged_kv_indices_buffer=self._graph_kv_indices,
            paged_kv_last_page_len_buffer=self._graph_kv_last_page_len[:batch_size],
        )
        # One int workspace for all buckets instead of 8 MiB each; safe because a replay always
        # follows its own bucket's plan on the same stream.
        wrapper.reset_workspace_buffer(self.workspace, self._int_workspace)
        self._graph_plan_key = None
        return FlashInferMetadata(wrapper, batch_size, None, graph_batch_size=batch_size)

    def plan(
        self,
        graph_metadata: FlashInferMetadata,
        batch: AttentionBatch,
        batch_size: int,
        plan_decode: PlanDecode,
    ) -> FlashInferMetadata:
        """Prepare for replay: re-plan the bucket's wrapper for this step, in place.

        Must run before every replay of the bucket's graph (and before its capture), on the
        replay's stream, with no other bucket planned in between: ``plan()`` writes this step's
        ``kv_indptr``/``kv_indices``/``kv_last_page_len`` into the fixed buffers the graph reads
        and the split-KV schedule into the shared int workspace. The step's requests are padded
        to ``batch_size`` with empty requests (their output rows are not meaningful; the runner
        slices them off).

        On the CUDA-core decode path (``use_tensor_cores`` False), when the batch carries its
        host block table and this bucket's previous plan was the last graph plan and had the
        same ``kv_indptr`` and page ids (the same requests on the same pages, as for most steps
        of a steady batch), flashinfer's ``plan()`` is skipped and only ``kv_last_page_len`` is
        copied: that path's schedule is computed from ``kv_indptr`` alone. The tensor-core path
        schedules by token counts and plans every step. A CUDA-core plan after the bucket's
        first is made without flashinfer's Python ``plan`` where that is safe
        (:class:`~fastdeploy.model_executor.layers.attention.flashinfer_plan.GraphDecodePlanner`,
        ``FD_FLASHINFER_DIRECT_PLAN``), its arrays moved with one copy.

        Args:
            graph_metadata: from :meth:`make_metadata` for ``batch_size``.
            batch: a decode-only step of at most ``batch_size`` requests, its tokens padded to
                ``batch_size`` rows (slot -1), its ``slot_mapping`` the buffer seen at capture.
            batch_size: the bucket.
            plan_decode: the backend's decode plan (see :data:`PlanDecode`).

        Raises:
            ValueError: wrong bucket, not decode-only, too many requests or pages, unpadded rows.
            RuntimeError: the slot mapping is not at the address the graph was captured with.
        """
        md = graph_metadata
        if md.graph_batch_size != batch_size:
            raise ValueError(f"metadata of bucket {md.graph_batch_size} planned for {batch_size}")
        if not batch.is_decode_only or batch.num_reqs > batch_size:
            raise ValueError(
                f"graph decode needs a decode-only step of <= {batch_size} requests, "
                f"got {batch.num_reqs} (decode_only={batch.is_decode_only})"
            )
        if batch.slot_mapping.shape[0] != batch_size:
            raise ValueError(
                f"pad the step's tokens to the bucket: slot_mapping has "
                f"{batch.slot_mapping.shape[0]} rows, bucket {batch_size}"
            )
        if md.slot_mapping is None:
            md.slot_mapping = batch.slot_mapping
        elif md.slot_mapping.data_ptr() != batch.slot_mapping.data_ptr():
            raise RuntimeError(
                "the step's slot_mapping is not the buffer the graph was captured "
                "with; copy slots into the runner's persistent buffer"
            )
        layout = paged_kv_layout(
            batch.query_lens_host,
            batch.seq_lens_host,
            self.block_size,
            batch.block_tables.shape[1],
            batch_size - batch.num_reqs,
        )
        if len(layout.page_rows) > self.max_num_blocks:
            raise ValueError(
                f"step needs {len(layout.page_rows)} pages, more than "
                f"max_num_blocks={self.max_num_blocks}"
            )
        page_ids = host_page_ids(batch, layout)
        key = None
        if page_ids is not None and not self.use_tensor_cores:
            key = (md.wrapper, layout.kv_indptr.numpy().tobytes(), page_ids.tobytes())
            if key == self._graph_plan_key:
                # The same requests on the same pages as this bucket's plan, which was the last
                # one written to the shared graph buffers: the CUDA-core decode schedule depends
                # on the page counts only (flashinfer's plan reads kv_indptr alone), so only the
                # tokens in each last page changed.
                self._staging.copy_last_page_len(layout, self._graph_kv_last_page_len[:batch_size])
                self._staging.queued()
                return md
        # Forgotten first: flashinfer's plan writes the shared buffers before it can fail.
        self._graph_plan_key = None
        arrays = None
        if self.planner is not None:
            arrays = self._staging.stage_graph_decode(layout, page_ids, self._graph_fixed)
        if arrays is not None:
            try:  # GraphDecodePlanner.plan(wrapper, arrays, ...), after _plan's wait for wrapper
                plan_decode(md.wrapper, md.wrapper, arrays, plan_fn=self.planner.plan)
            finally:  # the packed copy is queued even when the plan fails
                self._staging.queued()
        else:
            layout, indices = self._staging.stage(layout, batch, page_ids)
            plan_decode(md.wrapper, layout.kv_indptr, indices, layout.kv_last_page_len)
            self._staging.queued()
        self._graph_plan_key = key
        return md
