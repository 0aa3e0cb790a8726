"""PlanStaging on CPU: the page ids read from the host block table equal the device-side gather
they replace, for any layout (padding requests, partial last pages). The pinned, double-buffered
path runs on CUDA (tests/gpu/test_attention_gpu.py)."""

import numpy as np
import pytest
import torch

from fastdeploy.model_executor.layers.attention.backend import AttentionBatch
from fastdeploy.model_executor.layers.attention.flashinfer_layout import paged_kv_layout
from fastdeploy.model_executor.layers.attention.flashinfer_staging import (
    PlanStaging,
    host_page_ids,
)

BLOCK, WIDTH = 4, 6


def batch_of(seq_lens, with_host=True):
    g = torch.Generator().manual_seed(0)
    n = len(seq_lens)
    tables = torch.randint(1, 100, (n, WIDTH), generator=g, dtype=torch.int32)
    return AttentionBatch(
        num_reqs=n,
        num_tokens=n,
        query_start_loc=torch.arange(n + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        slot_mapping=torch.zeros(n, dtype=torch.int64),
        max_query_len=1,
        max_seq_len=max(seq_lens),
        is_decode_only=True,
        query_lens_host=[1] * n,
        seq_lens_host=list(seq_lens),
        block_tables_host=tables.numpy() if with_host else None,
    )


def test_host_page_ids_equal_the_device_gather():
    staging = PlanStaging(8, 64, torch.device("cpu"))
    for seq_lens, padding in (([1, 4, 5, 23], 0), ([9], 3), ([24, 2], 2)):
        batch = batch_of(seq_lens)
        layout = paged_kv_layout([1] * len(seq_lens), seq_lens, BLOCK, WIDTH, padding)
        ids = host_page_ids(batch, layout)
        assert ids.dtype == np.int32
        want = [int(batch.block_tables[r, p]) for r, s in enumerate(seq_lens) for p in
                range(-(-s // BLOCK))]  # fmt: skip
        assert ids.tolist() == want
        _, from_host = staging.stage(layout, batch, ids)
        _, gathered = staging.stage(layout, batch_of(seq_lens, with_host=False), None)
        assert from_host.dtype == gathered.dtype == torch.int32
        assert from_host.tolist() == gathered.tolist() == want


def test_no_host_table_means_no_host_ids():
    batch = batch_of([3, 7], with_host=False)
    assert host_page_ids(batch, paged_kv_layout([1, 1], [3, 7], BLOCK, WIDTH)) is None


def test_seq_lens_for_the_prefill_plan_equal_flashinfers_own():
    """The KV lengths handed to the prefill plan equal what flashinfer derives from the layout
    when none are given ((pages - 1) * page_size + last_page_len), partial last pages included."""
    staging = PlanStaging(8, 64, torch.device("cpu"))
    seq_lens = [1, 4, 5, 23]
    batch = batch_of(seq_lens)
    layout = paged_kv_layout([1] * 4, seq_lens, BLOCK, WIDTH)
    layout, _ = staging.stage(layout, batch, host_page_ids(batch, layout))
    got = staging.seq_lens(batch.seq_lens_host)
    assert got.dtype == torch.int32
    pages = layout.kv_indptr[1:] - layout.kv_indptr[:-1]
    derived = (pages - 1) * BLOCK + layout.kv_last_page_len
    assert got.tolist() == derived.tolist() == seq_lens


def packed_staging() -> PlanStaging:
    """A CPU PlanStaging whose packed device buffer is a CPU tensor, so stage_prefill runs."""
    staging = PlanStaging(8, 64, torch.device("cpu"))
    staging._packed_dev = torch.full((staging._sets.capacity("packed"),), -7, dtype=torch.int32)
    return staging


def test_stage_prefill_packs_the_plan_arrays_into_one_copy():
    staging = packed_staging()
    for query_lens, seq_lens in (([16], [16]), ([3, 1, 5], [23, 4, 5]), ([2, 2], [9, 24])):
        batch = batch_of(seq_lens)
        layout = paged_kv_layout(query_lens, seq_lens, BLOCK, WIDTH)
        ids = host_page_ids(batch, layout)
        arrays = staging.stage_prefill(layout, ids, seq_lens)
        assert arrays.qo_indptr.tolist() == arrays.qo_indptr_dev.tolist()
        assert arrays.qo_indptr.tolist() == layout.qo_indptr.tolist()
        assert arrays.kv_indptr.tolist() == arrays.kv_indptr_dev.tolist()
        assert arrays.kv_indptr.tolist() == layout.kv_indptr.tolist()
        assert arrays.last_page_len.tolist() == arrays.last_page_len_dev.tolist()
        assert arrays.last_page_len.tolist() == layout.kv_last_page_len.tolist()
        assert arrays.page_ids_dev.tolist() == ids.tolist()
        assert arrays.seq_lens.tolist() == seq_lens
        # the device arrays are one buffer, back to back
        dev = [arrays.qo_indptr_dev, arrays.kv_indptr_dev, arrays.last_page_len_dev,
               arrays.page_ids_dev]  # fmt: skip
        for before, after in zip(dev, dev[1:]):
            assert after.data_ptr() == before.data_ptr() + 4 * before.numel()
        assert dev[0].data_ptr() == staging._packed_dev.data_ptr()


def test_stage_prefill_reuses_its_views_and_bounds_them(monkeypatch):
    staging = packed_staging()
    seq_lens = [23, 4]
    layout = paged_kv_layout([3, 1], seq_lens, BLOCK, WIDTH)
    ids = host_page_ids(batch_of(seq_lens), layout)
    first = staging.stage_prefill(layout, ids, seq_lens)
    assert staging.stage_prefill(layout, ids, seq_lens) is first  # one set on CPU
    from fastdeploy.model_executor.layers.attention import flashinfer_staging

    monkeypatch.setattr(flashinfer_staging, "MAX_CACHED_VIEWS", 2)
    other = paged_kv_layout([1], [9], BLOCK, WIDTH)
    staging.stage_prefill(other, host_page_ids(batch_of([9]), other), [9])
    assert len(staging._view_cache) == 2
    third = paged_kv_layout([1], [1], BLOCK, WIDTH)
    staging.stage_prefill(third, host_page_ids(batch_of([1]), third), [1])
    assert len(staging._view_cache) == 1  # cleared when full


def test_stage_prefill_declines_what_it_cannot_pack():
    staging = packed_staging()
    batch = batch_of([3, 7])
    layout = paged_kv_layout([1, 1], [3, 7], BLOCK, WIDTH)
    assert staging.stage_prefill(layout, None, [3, 7]) is None  # no host page ids
    assert (
        PlanStaging(8, 64, torch.device("cpu")).stage_prefill(
            layout, host_page_ids(batch, layout), [3, 7]
        )
        is None
    )  # nothing pinned (CPU)
    padded = paged_kv_layout([1, 1], [3, 7], BLOCK, WIDTH, num_padding_reqs=2)
    with pytest.raises(ValueError, match="padding"):
        staging.stage_prefill(padded, host_page_ids(batch, padded), [3, 7])
