"""PackedBuffers: one allocation, aligned typed views, one prefix copy per upload."""

from __future__ import annotations

import pytest
import torch

from fastdeploy.core.host_staging import MERGE_GAP_BYTES, PACK_ALIGN, PackedBuffers
from fastdeploy.worker.input_batch import InputBuffers, dummy_step

SPECS = {
    "small": (5, torch.int32),
    "flags": (3, torch.bool),
    "tokens": (40, torch.int64),
}


def test_views_are_aligned_disjoint_and_typed():
    packed = PackedBuffers(SPECS, torch.device("cpu"))
    views = packed.device_views
    assert [v.dtype for v in views.values()] == [torch.int32, torch.bool, torch.int64]
    assert [v.numel() for v in views.values()] == [5, 3, 40]
    base = packed._device.data_ptr()
    offsets = [v.data_ptr() - base for v in views.values()]
    assert offsets == [0, PACK_ALIGN, 2 * PACK_ALIGN]
    assert packed.nbytes == 2 * PACK_ALIGN + 40 * 8
    views["tokens"].fill_(7)
    assert int(views["small"].sum()) == 0 and not views["flags"].any()


def test_upload_copies_the_used_parts_only():
    packed = PackedBuffers(SPECS, torch.device("cpu"))
    dev = packed.device_views
    dev["tokens"].fill_(-1)
    dev["flags"].fill_(False)
    host = packed.next()
    host["small"][:] = torch.arange(5, dtype=torch.int32)
    host["flags"][:] = True
    host["tokens"][:] = torch.arange(40)
    assert packed.upload({"small": 5, "tokens": 10}) == 1  # small gaps: one copy
    assert dev["small"].tolist() == [0, 1, 2, 3, 4]
    assert dev["flags"].all()  # in the gap: copied along (stale bytes, never read)
    assert dev["tokens"][:10].tolist() == list(range(10))
    assert (dev["tokens"][10:] == -1).all()  # past the used part: the device contents stay


def test_far_apart_parts_are_separate_copies_and_bad_counts_are_named():
    big = 3 * MERGE_GAP_BYTES // 8  # int64 elements: a buffer wider than the merge gap
    packed = PackedBuffers(
        {"a": (4, torch.int64), "b": (big, torch.int64), "c": (big, torch.int64)},
        torch.device("cpu"),
    )
    b_start = packed.ranges({"b": 1})[0][0]
    c_start = packed.ranges({"c": 1})[0][0]
    assert packed.ranges({"a": 4, "b": 2}) == [(0, b_start + 16)]  # gap < 64 KiB: merged
    assert packed.ranges({"a": 4, "b": 2, "c": 3}) == [(0, b_start + 16), (c_start, c_start + 24)]
    assert packed.ranges({"b": big, "c": 1}) == [(b_start, c_start + 8)]  # adjacent: merged
    host = packed.next()
    host["c"][:3] = torch.tensor([5, 6, 7])
    assert packed.upload({"a": 4, "b": 2, "c": 3}) == 2
    assert packed.device_views["c"][:3].tolist() == [5, 6, 7]
    with pytest.raises(ValueError, match=rf"{big + 1} elements of 'b': allowed 0..{big}"):
        packed.ranges({"b": big + 1})


def test_input_buffers_fill_every_field_of_a_step():
    """A step of two prefills (5 and 3 new tokens after 4 and 0 cached) and one decode, padded
    to 16: the packed buffers and the block table hold what the step says."""
    bufs = InputBuffers(
        max_num_tokens=32, max_num_reqs=4, max_blocks_per_seq=4, block_size=4,
        device=torch.device("cpu"),
    )  # fmt: skip
    sched = dummy_step([5, 3, 1], block_size=4, history=0)
    sched.scheduled[0].num_computed_tokens = 4
    req0 = sched.scheduled[0].request
    req0.prompt_token_ids = list(range(100, 109))
    req0.block_ids = [7, 8, 9]
    step = bufs.prepare(sched, padded=16)
    assert step.num_tokens == 9 and step.padded == 16
    assert bufs.query_start_loc[:4].tolist() == [0, 5, 8, 9]
    assert bufs.seq_lens[:3].tolist() == [9, 3, 1]
    assert step.input_ids[:5].tolist() == [104, 105, 106, 107, 108]
    assert step.positions[:9].tolist() == [4, 5, 6, 7, 8, 0, 1, 2, 0]
    assert step.input_ids[9:].tolist() == [0] * 7 and step.positions[9:].tolist() == [0] * 7
    # request 0: positions 4..8 sit in blocks 8 (4..7) and 9 (8)
    assert step.batch.slot_mapping[:5].tolist() == [32, 33, 34, 35, 36]
    assert step.batch.slot_mapping[9:].tolist() == [-1] * 7
    assert bufs.block_tables[0, :3].tolist() == [7, 8, 9]
    assert step.logits_indices.tolist() == [4, 7, 8]


def test_block_tables_equal_a_full_rewrite_over_steps_of_changing_width():
    """fill_block_tables touches only the leading columns; after any sequence of steps every
    table equals a from-scratch fill (ids, then zeros; rows past the step zero)."""
    import random

    import numpy as np

    from fastdeploy.worker.step_gather import fill_block_tables

    rng = random.Random(0)
    tables = np.full((6, 40), 99, dtype=np.int32)  # garbage: the first call clears it all
    dirty = tables.shape
    for step in range(60):
        num_reqs = rng.randint(0, 6)
        widest = rng.choice([3, 8, 40]) if step % 7 else 40
        num_blocks = [rng.randint(0, widest) for _ in range(num_reqs)]
        block_ids = [rng.randint(1, 1000) for _ in range(sum(num_blocks))]
        dirty = fill_block_tables(tables, block_ids, num_blocks, dirty)
        expected = np.zeros_like(tables)
        at = 0
        for i, n in enumerate(num_blocks):
            expected[i, :n] = block_ids[at : at + n]
            at += n
        assert (tables == expected).all(), f"step {step}"
        assert dirty == (num_reqs, max(num_blocks, default=0))


def test_a_small_step_is_one_copy_with_its_block_table_rows():
    """The block table is packed with the per-request buffers: a step of small buffers uploads
    in one copy, a table too wide to merge in two; over steps of changing width each device row
    equals the step's block ids (zeros past them)."""
    small = InputBuffers(
        max_num_tokens=64, max_num_reqs=8, max_blocks_per_seq=4, block_size=4,
        device=torch.device("cpu"),
    )  # fmt: skip
    copies = []
    upload = small._packed.upload
    small._packed.upload = lambda used: copies.append(upload(used)) or copies[-1]
    for sizes, ids in (([5, 3], [[7, 8], [9]]), ([1], [[4, 5, 6]]), ([2, 2, 2], [[1], [2], [3]])):
        sched = dummy_step(sizes, block_size=4)
        for s, blocks in zip(sched.scheduled, ids):
            s.request.block_ids = blocks
        small.prepare(sched)
        for row, blocks in enumerate(ids):
            assert small.block_tables[row].tolist() == blocks + [0] * (4 - len(blocks))
    assert copies == [1, 1, 1]
    wide = InputBuffers(
        max_num_tokens=64, max_num_reqs=64, max_blocks_per_seq=512, block_size=4,
        device=torch.device("cpu"),
    )  # fmt: skip
    sched = dummy_step([3], block_size=4)
    sched.scheduled[0].request.block_ids = [11]
    used = {"block_tables": 512, "input_ids": 3, "query_start_loc": 2}
    assert len(wide._packed.ranges(used)) == 2  # 63 unused rows of 2 KiB: not copied
    wide.prepare(sched)
    assert wide.block_tables[0, :2].tolist() == [11, 0]


def two_host_sets(bufs: InputBuffers) -> None:
    """Give a CPU InputBuffers the two alternating host sets it has on CUDA (each set's block
    table is then cleared by its own dirty corner, two steps apart)."""
    staging = bufs._packed.staging
    staging._sets.append({name: t.clone() for name, t in staging._sets[0].items()})
    staging._events.append(None)

    def next_set():
        staging._index ^= 1
        return staging._sets[staging._index]

    staging.next = next_set


@pytest.mark.parametrize("max_reqs,width", [(8, 4), (64, 512)])
def test_block_tables_over_two_alternating_host_sets(max_reqs: int, width: int):
    """300 random steps (changing request counts and widths; merged and unmerged table gaps):
    every step's device rows and host rows equal its block ids, zeros past them, whichever of
    the two host sets it was filled through."""
    import random

    bufs = InputBuffers(
        max_num_tokens=256, max_num_reqs=max_reqs, max_blocks_per_seq=width, block_size=4,
        device=torch.device("cpu"),
    )  # fmt: skip
    two_host_sets(bufs)
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, max_reqs)
        sizes = [rng.randint(1, 3) for _ in range(n)]
        sched = dummy_step(sizes, block_size=4)
        ids = []
        for s in sched.scheduled:
            s.request.block_ids = [rng.randint(1, 999) for _ in range(rng.randint(1, width))]
            ids.append(s.request.block_ids)
        step = bufs.prepare(sched)
        for row, blocks in enumerate(ids):
            want = blocks + [0] * (width - len(blocks))
            assert bufs.block_tables[row].tolist() == want
            assert step.batch.block_tables_host[row].tolist() == want
    assert len(bufs._views) == 2 and len(bufs._table_dirty) == 2
