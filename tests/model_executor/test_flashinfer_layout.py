"""paged_kv_layout on CPU: the list path for a few requests gives exactly what the numpy path
gives (values, dtypes, errors), and a worked example."""

import random

import numpy as np
import pytest
import torch

from fastdeploy.model_executor.layers.attention import flashinfer_layout
from fastdeploy.model_executor.layers.attention.flashinfer_layout import paged_kv_layout

BLOCK, WIDTH = 16, 4


def both_paths(monkeypatch, *args):
    """``(list path, numpy path)`` results (or raised ValueError messages) for ``args``."""
    out = []
    for small in (flashinfer_layout.SMALL_BATCH, -1):
        monkeypatch.setattr(flashinfer_layout, "SMALL_BATCH", small)
        try:
            out.append(paged_kv_layout(*args))
        except ValueError as e:
            out.append(str(e))
    monkeypatch.undo()
    return out


def assert_same(a, b):
    if isinstance(a, str) or isinstance(b, str):
        assert a == b
        return
    for name in ("qo_indptr", "kv_indptr", "kv_last_page_len"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype == torch.int32 and x.tolist() == y.tolist(), name
    assert a.page_rows.dtype == b.page_rows.dtype == np.int64
    assert a.page_rows.tolist() == b.page_rows.tolist()


def test_worked_example():
    layout = paged_kv_layout([1, 3, 1], [1, 16, 17], BLOCK, WIDTH, num_padding_reqs=2)
    assert layout.qo_indptr.tolist() == [0, 1, 4, 5, 5, 5]
    assert layout.kv_indptr.tolist() == [0, 1, 2, 4, 4, 4]
    assert layout.kv_last_page_len.tolist() == [1, 16, 1, 1, 1]
    assert layout.page_rows.tolist() == [0, 4, 8, 9]


def test_list_path_equals_numpy_path(monkeypatch):
    rng = random.Random(0)
    for _ in range(400):
        n = rng.randint(0, flashinfer_layout.SMALL_BATCH + 3)
        seq = [rng.randint(1, WIDTH * BLOCK) for _ in range(n)]
        query = [rng.randint(0, s) for s in seq]
        padding = rng.randint(0, 3)
        assert_same(*both_paths(monkeypatch, query, seq, BLOCK, WIDTH, padding))


@pytest.mark.parametrize(
    "query, seq",
    [([1], [0]), ([-1], [4]), ([5], [4]), ([1, 1], [3, WIDTH * BLOCK + 1]), ([1], [1, 2])],
    ids=["empty-seq", "negative-query", "query-past-seq", "too-many-blocks", "length-mismatch"],
)
def test_both_paths_reject_bad_lengths_alike(monkeypatch, query, seq):
    small, large = both_paths(monkeypatch, query, seq, BLOCK, WIDTH)
    assert isinstance(small, str) and small == large
