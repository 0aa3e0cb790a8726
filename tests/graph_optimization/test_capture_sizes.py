"""The default capture ladder, bucket choice and padding."""

from __future__ import annotations

import pytest

from fastdeploy.model_executor.graph_optimization.capture_sizes import (
    capture_ladder,
    default_decode_sizes,
    default_prefill_sizes,
    normalize_sizes,
    num_padding,
    pick_bucket,
)


def _full_ladder() -> list[int]:
    """The specification's ladder written out independently of the implementation."""
    sizes = [1, 2, 4]
    sizes += list(range(8, 129, 8))
    sizes += list(range(144, 257, 16))
    sizes += list(range(288, 1025, 32))
    sizes += list(range(1088, 2049, 64))
    sizes += list(range(2304, 4097, 256))
    sizes += list(range(4608, 8193, 512))
    return sizes


@pytest.mark.parametrize(
    ("max_num_seqs", "expected"),
    [
        (1, [1]),
        (2, [2, 1]),
        (3, [3, 2, 1]),
        (4, [4, 2, 1]),
        (8, [8, 4, 2, 1]),
        (20, [20, 16, 8, 4, 2, 1]),
        (32, [32, 24, 16, 8, 4, 2, 1]),
        (130, [130, *range(128, 7, -8), 4, 2, 1]),
        (150, [150, 144, *range(128, 7, -8), 4, 2, 1]),
    ],
)
def test_default_decode_sizes_small(max_num_seqs, expected):
    assert default_decode_sizes(max_num_seqs) == expected


def test_default_decode_sizes_capped_at_512():
    expected = sorted((s for s in _full_ladder() if s <= 512), reverse=True)
    assert default_decode_sizes(256) == [s for s in expected if s <= 256]
    assert default_decode_sizes(512) == expected
    assert default_decode_sizes(4096) == expected  # min(512, max_num_seqs)
    assert default_decode_sizes(1000) == expected


def test_default_decode_sizes_256_shape():
    sizes = default_decode_sizes(256)
    assert sizes[:4] == [256, 240, 224, 208]
    assert sizes[-5:] == [16, 8, 4, 2, 1]
    assert len(sizes) == 3 + 16 + 8


@pytest.mark.parametrize(
    ("max_capture_shape_prefill", "max_num_batched_tokens", "expected"),
    [
        (8192, 16, [16, 8, 4, 2, 1]),
        (8192, 50, [50, 48, 40, 32, 24, 16, 8, 4, 2, 1]),
        (40, 2048, [40, 32, 24, 16, 8, 4, 2, 1]),
        (
            300,
            8192,
            [300, 288, 256, 240, 224, 208, 192, 176, 160, 144, *range(128, 7, -8), 4, 2, 1],
        ),
    ],
)
def test_default_prefill_sizes_small(max_capture_shape_prefill, max_num_batched_tokens, expected):
    assert default_prefill_sizes(max_capture_shape_prefill, max_num_batched_tokens) == expected


def test_default_prefill_sizes_large():
    full = sorted(_full_ladder(), reverse=True)
    assert default_prefill_sizes(8192, 8192) == full
    assert default_prefill_sizes(8192, 2048) == [s for s in full if s <= 2048]
    # The cap is added even when it is not on the ladder, and beyond the ladder's end.
    assert default_prefill_sizes(8192, 3000) == [3000] + [s for s in full if s <= 3000]
    assert default_prefill_sizes(16384, 16384) == [16384] + full
    sizes = default_prefill_sizes(8192, 2048)
    assert sizes[:3] == [2048, 1984, 1920]
    assert 1024 in sizes and 1056 not in sizes and 1088 in sizes


def test_ladder_sorted_descending_and_distinct():
    for cap in (1, 7, 100, 513, 2048, 5000, 8192):
        sizes = capture_ladder(cap)
        assert sizes == sorted(set(sizes), reverse=True)
        assert sizes[0] == cap
        assert sizes[-1] == 1


@pytest.mark.parametrize("cap", [0, -1, 2.5, True, None])
def test_ladder_rejects_bad_cap(cap):
    with pytest.raises(ValueError, match=r"cap=.* is invalid; allowed: an integer >= 1"):
        capture_ladder(cap)


def test_normalize_sizes_dedupes_and_sorts():
    assert normalize_sizes([4, 1, 16, 4, 2]) == [16, 4, 2, 1]


SIZES = [64, 32, 16, 8, 4, 2, 1]


@pytest.mark.parametrize(
    ("n", "bucket", "padding"),
    [
        (1, 1, 0),  # below / at the smallest bucket
        (3, 4, 1),  # between buckets
        (8, 8, 0),  # exactly at a bucket
        (9, 16, 7),  # just above a bucket
        (33, 64, 31),
        (64, 64, 0),  # at the largest bucket
    ],
)
def test_pick_bucket_and_padding(n, bucket, padding):
    assert pick_bucket(SIZES, n) == bucket
    assert num_padding(bucket, n) == padding


def test_pick_bucket_below_smallest_bucket():
    assert pick_bucket([256, 128, 16], 1) == 16
    assert num_padding(16, 1) == 15


def test_pick_bucket_above_largest_is_none():
    assert pick_bucket(SIZES, 65) is None
    assert pick_bucket(SIZES, 10_000) is None
    assert pick_bucket([], 1) is None


def test_pick_bucket_irregular_sizes():
    sizes = [20, 16, 8, 4, 2, 1]
    assert [pick_bucket(sizes, n) for n in range(1, 22)] == (
        [1, 2, 4, 4] + [8] * 4 + [16] * 8 + [20] * 4 + [None]
    )


def test_pick_bucket_rejects_non_positive():
    with pytest.raises(ValueError, match=r"n=0 is invalid; allowed: an integer >= 1"):
        pick_bucket(SIZES, 0)


@pytest.mark.parametrize("n", [0, 9])
def test_num_padding_rejects_out_of_range(n):
    with pytest.raises(ValueError, match=rf"n={n} is invalid; allowed: 1 <= n <= bucket=8"):
        num_padding(8, n)
