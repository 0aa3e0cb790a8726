"""The host arrays of a flashinfer plan, moved to the device without waiting for it.

flashinfer's ``plan`` copies the page layout (``kv_indptr``, ``kv_last_page_len``, ...) to the
device itself, and the backend copies the page ids. From pageable memory such a copy is staged
by the driver, which can wait for the stream, i.e. for the step the GPU is still running under
the overlap schedule: the host then idles until the GPU drains and the GPU idles while the host
finishes the step. :class:`PlanStaging` keeps two pinned sets of these arrays
(:class:`~fastdeploy.core.host_staging.StagingSets`: a set is refilled only after the copies of
the plan two back ran) and reads the page ids from the runner's host block table, so one copy
replaces the device gather (an index upload, a gather and a cast kernel).

The prefill plan also gets the KV length of each request (``seq_lens``) from a pinned set:
without it flashinfer 0.5.3 derives ``kv_lens_arr_host`` itself, in pageable memory, and copies
that. Not covered: the non-graph decode plan's ``qo_indptr`` range, which flashinfer builds itself.
The graph decode plan has none.
"""

from __future__ import annotations

import numpy as np
import torch

from fastdeploy.core.host_staging import StagingSets
from fastdeploy.model_executor.layers.attention.backend import AttentionBatch
from fastdeploy.model_executor.layers.attention.flashinfer_layout import PagedKVLayout


def host_page_ids(batch: AttentionBatch, layout: PagedKVLayout) -> np.ndarray | None:
    """int32 ``[num_pages]`` block id of every page of ``layout`` from the batch's host block
    table, or None when the batch has none."""
    table = batch.block_tables_host
    if table is None:
        return None
    if table.shape != tuple(batch.block_tables.shape):
        raise ValueError(
            f"block_tables_host {table.shape} differs from block_tables "
            f"{tuple(batch.block_tables.shape)}"
        )
    return table.reshape(-1)[np.asarray(layout.page_rows)].astype(np.int32, copy=False)


class PlanStaging:
    """Pinned sets for the plans of one backend.

    Args:
        max_num_reqs: most requests of a plan (graph buckets included).
        max_num_blocks: most pages of a plan.
        device: the backend's device; on CPU nothing is staged (a copy is done when it returns).
    """

    def __init__(self, max_num_reqs: int, max_num_blocks: int, device: torch.device) -> None:
        self.device = device
        self._sets = StagingSets(
            {
                "qo_indptr": ((max_num_reqs + 1,), torch.int32),
                "kv_indptr": ((max_num_reqs + 1,), torch.int32),
                "kv_last_page_len": ((max_num_reqs,), torch.int32),
                "page_ids": ((max_num_blocks,), torch.int32),
                "page_rows": ((max_num_blocks,), torch.int64),
                "seq_lens": ((max_num_reqs,), torch.int32),
            },
            device,
        )
        self._current: dict[str, torch.Tensor] | None = None

    def stage(
        self, layout: PagedKVLayout, batch: AttentionBatch, page_ids: np.ndarray | None
    ) -> tuple[PagedKVLayout, torch.Tensor]:
        """``(layout, page ids)``: the layout's tensors in the next pinned set, and int32
        ``[num_pages]`` page ids on the device, copied from ``page_ids`` (from
        :func:`host_page_ids`) or, without them, gathered from the device block table. A layout
        larger than the sets (never in the engine) is copied from where it is. Call
        :meth:`queued` once the plan that reads them is done."""
        pinned = self._sets.is_async and self._fits(layout)
        self._current = None
        if pinned:
            staged = self._current = self._sets.next()
            out = {}
            for name in ("qo_indptr", "kv_indptr", "kv_last_page_len"):
                src = getattr(layout, name)
                out[name] = staged[name][: src.numel()]
                out[name].copy_(src)
            rows = layout.page_rows
            if page_ids is None:  # the rows are uploaded for the device gather
                rows = staged["page_rows"][: len(layout.page_rows)]
                rows.numpy()[:] = layout.page_rows
            layout = PagedKVLayout(
                out["qo_indptr"], out["kv_indptr"], out["kv_last_page_len"], rows
            )
            if page_ids is not None:
                ids = staged["page_ids"][: len(page_ids)]
                ids.numpy()[:] = page_ids
                return layout, ids.to(self.device, non_blocking=True)
        elif page_ids is not None:
            return layout, torch.from_numpy(page_ids).to(self.device, non_blocking=True)
        return layout, self._gather(batch.block_tables, layout.page_rows)

    def seq_lens(self, seq_lens: list[int]) -> torch.Tensor:
        """int32 ``[num_reqs]`` KV length of each request of the layout just staged, in that
        layout's pinned set (a plain CPU tensor when :meth:`stage` did not pin), for flashinfer's
        prefill ``plan(seq_lens=...)``."""
        if self._current is None or len(seq_lens) > self._sets.capacity("seq_lens"):
            return torch.tensor(seq_lens, dtype=torch.int32)
        out = self._current["seq_lens"][: len(seq_lens)]
        out.numpy()[:] = seq_lens
        return out

    def copy_last_page_len(self, layout: PagedKVLayout, dst: torch.Tensor) -> None:
        """Copy ``layout.kv_last_page_len`` into the device tensor ``dst`` through the next
        pinned set (then :meth:`queued`)."""
        src = layout.kv_last_page_len
        if self._sets.is_async and src.numel() <= self._sets.capacity("kv_last_page_len"):
            staged = self._sets.next()["kv_last_page_len"][: src.numel()]
            staged.copy_(src)
            src = staged
        dst.copy_(src, non_blocking=True)

    def queued(self) -> None:
        """The copies out of the current set are queued on the stream."""
        self._sets.copies_queued()

    def _fits(self, layout: PagedKVLayout) -> bool:
        return (
            layout.kv_indptr.numel() <= self._sets.capacity("kv_indptr")
            and layout.qo_indptr.numel() <= self._sets.capacity("qo_indptr")
            and len(layout.page_rows) <= self._sets.capacity("page_rows")
        )

    def _gather(
        self, block_tables: torch.Tensor, page_rows: np.ndarray | torch.Tensor
    ) -> torch.Tensor:
        """int32 ``[num_pages]`` block ids gathered from the (device) block table."""
        table = block_tables.reshape(-1)
        rows = torch.as_tensor(page_rows)
        if table.device.type == "cpu":
            return table.index_select(0, rows).to(device=self.device, dtype=torch.int32)
        rows = rows.to(table.device, non_blocking=True)
        return table.index_select(0, rows).to(torch.int32)
