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

A prefill plan that :mod:`~fastdeploy.model_executor.layers.attention.flashinfer_plan` makes
without flashinfer's Python ``plan`` takes its arrays from :meth:`PlanStaging.stage_prefill`:
``qo_indptr``, ``kv_indptr``, ``kv_last_page_len`` and the page ids packed back to back in one
pinned int32 buffer and moved with one copy into a device buffer the backend keeps (flashinfer's
``plan`` makes three copies into new device tensors, and the backend a fourth for the page ids).
A CUDA-graph decode plan made without ``plan`` likewise takes ``kv_indptr``, ``kv_last_page_len``
and the page ids from :meth:`PlanStaging.stage_graph_decode`: one copy into the decode graphs'
fixed buffers, which the backend keeps in one device buffer laid out the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fastdeploy.core.host_staging import StagingSets, remember
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


@dataclass
class PrefillArrays:
    """One prefill plan's arrays from :meth:`PlanStaging.stage_prefill` (``R`` requests, ``P``
    pages), int32 each.

    Attributes:
        qo_indptr / kv_indptr / last_page_len / seq_lens: pinned CPU ``[R + 1]`` / ``[R + 1]``
            / ``[R]`` / ``[R]``: cumulative query lengths, cumulative page counts, tokens in
            each request's last page, KV length of each request (what flashinfer's plan reads
            on the host).
        qo_indptr_dev / kv_indptr_dev / last_page_len_dev / page_ids_dev: device ``[R + 1]`` /
            ``[R + 1]`` / ``[R]`` / ``[P]``, views of one buffer filled by one copy, what the
            attention kernel reads.
    """

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    last_page_len: torch.Tensor
    seq_lens: torch.Tensor
    qo_indptr_dev: torch.Tensor
    kv_indptr_dev: torch.Tensor
    last_page_len_dev: torch.Tensor
    page_ids_dev: torch.Tensor


#: Most ``(set, requests, pages)`` shapes whose prefill views :class:`PlanStaging` keeps.
MAX_CACHED_VIEWS = 512


@dataclass
class GraphDecodeArrays:
    """One CUDA-graph decode plan's host arrays from :meth:`PlanStaging.stage_graph_decode`
    (``B`` requests of the bucket, padding included, ``P`` pages), int32 pinned CPU tensors
    whose copy to the graphs' fixed buffers is already queued.

    Attributes:
        kv_indptr / last_page_len / page_ids: ``[B + 1]`` cumulative page counts, ``[B]``
            tokens in each request's last page, ``[P]`` block id of every page.
    """

    kv_indptr: torch.Tensor
    last_page_len: torch.Tensor
    page_ids: torch.Tensor


class PlanStaging:
    """Pinned sets for the plans of one backend.

    Args:
        max_num_reqs: most requests of a plan (graph buckets included).
        max_num_blocks: most pages of a plan.
        device: the backend's device; on CPU nothing is staged (a copy is done when it returns).
    """

    def __init__(self, max_num_reqs: int, max_num_blocks: int, device: torch.device) -> None:
        self.device = device
        self.max_num_reqs = max_num_reqs
        self.max_num_blocks = max_num_blocks
        self._sets = StagingSets(
            {
                "qo_indptr": ((max_num_reqs + 1,), torch.int32),
                "kv_indptr": ((max_num_reqs + 1,), torch.int32),
                "kv_last_page_len": ((max_num_reqs,), torch.int32),
                "page_ids": ((max_num_blocks,), torch.int32),
                "page_rows": ((max_num_blocks,), torch.int64),
                "seq_lens": ((max_num_reqs,), torch.int32),
                "packed": ((self._packed_size(max_num_reqs, max_num_blocks),), torch.int32),
            },
            device,
        )
        self._current: dict[str, torch.Tensor] | None = None
        # Filled by one copy a prefill plan; reused every plan (the copy and the kernels that
        # read it are on one stream, so a plan's copy runs after the previous step's kernels).
        self._packed_dev = (
            torch.zeros(self._sets.capacity("packed"), dtype=torch.int32, device=device)
            if self._sets.is_async
            else None
        )
        self._view_cache: dict[tuple[int, int, int], tuple] = {}  # see _prefill_views

    @staticmethod
    def _packed_size(max_num_reqs: int, max_num_blocks: int) -> int:
        """int32 elements of a packed prefill set: ``qo_indptr``, ``kv_indptr`` (``R + 1`` each),
        ``kv_last_page_len`` (``R``), page ids (``P``); a graph decode plan uses the same buffer
        (:meth:`graph_decode_size`, which is smaller)."""
        return 3 * max_num_reqs + 2 + max_num_blocks

    def stage_prefill(
        self, layout: PagedKVLayout, page_ids: np.ndarray | None, seq_lens: list[int]
    ) -> PrefillArrays | None:
        """The arrays of a prefill plan (:class:`PrefillArrays`), packed into the next pinned set
        and copied to the device with one non-blocking copy; None where nothing is pinned (CPU),
        the batch has no host page ids, or the layout is larger than the sets (the caller then
        uses :meth:`stage`). Call :meth:`queued` once the plan is done.

        The device arrays live in one buffer that the next call overwrites (with a copy queued
        on the stream after whatever was queued before it): run the step that reads them before
        staging the next prefill plan, as the engine does (one step's metadata, then its
        forward)."""
        self._current = None
        if self._packed_dev is None or page_ids is None or not self._fits(layout):
            return None
        n = len(seq_lens)
        pages = len(page_ids)
        if layout.kv_last_page_len.numel() != n or layout.qo_indptr.numel() != n + 1:
            raise ValueError(
                f"a layout of {layout.kv_last_page_len.numel()} requests staged with "
                f"{n} sequence lengths (padding requests have no prefill plan)"
            )
        staged = self._current = self._sets.next()
        host, copy_from, copy_to, arrays = self._prefill_views(staged, n, pages)
        a, b, c = n + 1, 2 * n + 2, 3 * n + 2
        host[:a] = layout.qo_indptr.numpy()
        host[a:b] = layout.kv_indptr.numpy()
        host[b:c] = layout.kv_last_page_len.numpy()
        host[c:] = page_ids
        arrays.seq_lens.numpy()[:] = seq_lens
        copy_to.copy_(copy_from, non_blocking=True)
        return arrays

    def _prefill_views(
        self, staged: dict[str, torch.Tensor], n: int, pages: int
    ) -> tuple[np.ndarray, torch.Tensor, torch.Tensor, PrefillArrays]:
        """``(host numpy view, pinned source, device destination, arrays)`` of a prefill plan of
        ``n`` requests and ``pages`` pages in the pinned set ``staged``. Made once per set and
        size and kept (at most :data:`MAX_CACHED_VIEWS`): at a few microseconds a tensor view,
        the eleven views were most of this method's host time (p50 61.7 and 77.5 us before,
        38.0 and 21.5 after, on two H200 hosts whose million-addition loop took 128-143 ms). A
        step of the same requests and pages as an earlier one (a benchmark's repeated step, a
        steady stream of same-length prompts) reuses them; in serving, where the pages change
        from step to step, most are made anew."""
        key = (id(staged), n, pages)
        views = self._view_cache.get(key)
        if views is None:
            used = 3 * n + 2 + pages
            packed = staged["packed"][:used]
            dev = self._packed_dev[:used]
            a, b, c = n + 1, 2 * n + 2, 3 * n + 2
            arrays = PrefillArrays(
                qo_indptr=packed[:a],
                kv_indptr=packed[a:b],
                last_page_len=packed[b:c],
                seq_lens=staged["seq_lens"][:n],
                qo_indptr_dev=dev[:a],
                kv_indptr_dev=dev[a:b],
                last_page_len_dev=dev[b:c],
                page_ids_dev=dev[c:],
            )
            views = (packed.numpy(), packed, dev, arrays)
            remember(self._view_cache, key, views, MAX_CACHED_VIEWS)
        return views

    @staticmethod
    def graph_decode_size(max_num_reqs: int, max_num_blocks: int) -> int:
        """int32 elements of the decode graphs' fixed buffers packed in one device buffer:
        ``kv_indptr`` at 0 (``R + 1``), ``kv_last_page_len`` at ``R + 1`` (``R``), the page ids
        at ``2R + 1`` (``max_num_blocks``); see :meth:`stage_graph_decode`."""
        return 2 * max_num_reqs + 1 + max_num_blocks

    def stage_graph_decode(
        self, layout: PagedKVLayout, page_ids: np.ndarray | None, fixed: torch.Tensor
    ) -> GraphDecodeArrays | None:
        """Write a graph decode plan's ``kv_indptr``, ``kv_last_page_len`` and page ids into the
        next pinned set, laid out as the decode graphs' fixed buffers are in ``fixed``
        (:meth:`graph_decode_size`), and queue one non-blocking copy of the used range into
        ``fixed``; returns the pinned host arrays (:class:`GraphDecodeArrays`). None where
        nothing is pinned (CPU), the batch has no host page ids or the layout does not fit (the
        caller then uses :meth:`stage`). Call :meth:`queued` once the plan is done.

        The range between a bucket's arrays (up to ``max_num_reqs`` requests) is copied too:
        a replay reads only its own bucket's part of each fixed buffer, rewritten by its plan."""
        self._current = None
        if self._packed_dev is None or page_ids is None:
            return None
        r = self.max_num_reqs
        b = layout.kv_last_page_len.numel()
        p = len(page_ids)
        if b > r or p > self.max_num_blocks or layout.kv_indptr.numel() != b + 1:
            return None
        staged = self._current = self._sets.next()
        key = (id(staged), id(fixed), b, p)
        views = self._view_cache.get(key)
        if views is None:
            used = 2 * r + 1 + p
            packed = staged["packed"][:used]
            arrays = GraphDecodeArrays(
                kv_indptr=packed[: b + 1],
                last_page_len=packed[r + 1 : r + 1 + b],
                page_ids=packed[2 * r + 1 :],
            )
            views = (packed.numpy(), packed, fixed[:used], arrays)
            remember(self._view_cache, key, views, MAX_CACHED_VIEWS)
        host, src, dst, arrays = views
        host[: b + 1] = layout.kv_indptr.numpy()
        host[r + 1 : r + 1 + b] = layout.kv_last_page_len.numpy()
        host[2 * r + 1 :] = page_ids
        dst.copy_(src, non_blocking=True)
        return arrays

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
