"""Host-side pieces of the flashinfer backend that need no GPU: the float workspace size every
plan fits in, a step's attention metadata (:class:`FlashInferMetadata`), and a batch's pages in
flashinfer's CSR form (``kv_indptr``, ``kv_indices``, ``kv_last_page_len``) built from host
lengths. Kept apart from
:mod:`~fastdeploy.model_executor.layers.attention.flashinfer_backend` (which re-exports them) so
that file holds the backend itself."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import numpy as np
import torch

#: Least float workspace shared by all wrappers (split-KV partial results); flashinfer recommends
#: 128 MiB, and :func:`float_workspace_bytes` raises it where a split-KV prefill needs more.
WORKSPACE_BYTES = 128 << 20
#: Reserve on top of the split-KV prefill bound (alignment padding, the tmp_s rows).
WORKSPACE_MARGIN_BYTES = 16 << 20


def _cta_tile_q(packed_qo_len: int, head_dim: int, sm_major: int) -> int:
    """Query rows per CTA of flashinfer's FA2 prefill kernel (0.5.3 ``utils.cuh``,
    ``FA2DetermineCtaTileQ``) for ``packed_qo_len`` query rows times the GQA group."""
    if packed_qo_len > 64 and head_dim < 256:
        return 128
    if sm_major < 8:
        return 64
    return 64 if packed_qo_len > 16 else 16


def float_workspace_bytes(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    num_sms: int,
    max_graph_decode_batch: int = 0,
    sm_major: int = 9,
) -> int:
    """Float workspace that every plan fits in: at least :data:`WORKSPACE_BYTES`, the most a
    split-KV prefill plan takes, and the most a tensor-core decode plan of a CUDA graph takes.

    From flashinfer 0.5.3 ``attention/scheduler.cuh`` (``PrefillPlan``): a split-KV prefill
    allocates ``tmp_v = num_qo_heads * padded_batch_size * cta_tile_q * head_dim * 4`` bytes and
    ``tmp_s`` (the same without ``head_dim``), where ``padded_batch_size <= 2 * num_sms /
    num_kv_heads`` (two CTAs per SM, split only while the tiles fit) and ``cta_tile_q <= 128``.
    With 32 query and 4 KV heads of 128 (Qwen3-30B-A3B) on 132 SMs that is 139 MB: more than the
    128 MiB flashinfer suggests, which overflowed at 8,192-token prefills.

    Decode on the tensor-core kernel (``max_graph_decode_batch`` > 0: the largest decode graph's
    batch) plans through the same ``PrefillPlan``, and inside a CUDA graph it always splits KV
    and pads to ``max(2 * num_sms / num_kv_heads, ceil(B * group / cta_tile_q) + B - 1)``
    tiles, ``cta_tile_q`` taken for ``group`` query rows: at Llama-3-8B's 32/8 heads and B =
    512 that is 639 tiles of 16 rows, 169 MB.

    Args:
        num_heads, num_kv_heads, head_dim: the attention shape.
        num_sms: the GPU's streaming multiprocessors.
        max_graph_decode_batch: the largest decode graph's requests when decode runs on
            flashinfer's tensor-core kernel; 0 otherwise.
        sm_major: the GPU's compute capability major (below 8 flashinfer uses 64-row tiles).
    """
    ctas_per_kv_head = 2 * num_sms // num_kv_heads
    need = num_heads * ctas_per_kv_head * 128 * (head_dim + 1) * 4
    if max_graph_decode_batch > 0:
        group = num_heads // num_kv_heads
        tile_q = _cta_tile_q(group, head_dim, sm_major)
        batch = max_graph_decode_batch
        tiles = max(ctas_per_kv_head, -(-batch * group // tile_q) + batch - 1)
        need = max(need, num_heads * tiles * tile_q * (head_dim + 1) * 4)
    return max(WORKSPACE_BYTES, need + WORKSPACE_MARGIN_BYTES)


@dataclass
class FlashInferMetadata:
    """One step's attention metadata (or a decode bucket's, for a CUDA graph).

    Attributes:
        wrapper: the planned flashinfer wrapper (None for a step without requests).
        num_tokens: rows of ``q`` the wrapper runs on (the first ones); rows past it are padding.
            For graph decode metadata it is the bucket size (padding requests are planned empty).
        slot_mapping: int64 ``[>= T]`` device slots of the step's tokens (-1: write nothing).
        graph_batch_size: the bucket size when bound to a decode CUDA graph, else 0.
    """

    wrapper: Any
    num_tokens: int
    slot_mapping: torch.Tensor | None
    graph_batch_size: int = 0


#: Batches of at most this many requests are laid out with Python lists (:func:`_small_layout`):
#: the numpy path's twenty-odd calls cost about a microsecond each whatever the size. On a 2-core
#: VM, numpy against lists: 20.7 against 11.0 us at one request, 22.4 against 18.7 at eight,
#: 23.8 against 27.1 at sixteen.
SMALL_BATCH = 8


@dataclass
class PagedKVLayout:
    """A batch's pages in flashinfer's CSR form, built on the host.

    Attributes:
        qo_indptr: int32 CPU ``[R + 1]``, cumulative query lengths (``R`` = requests incl. padding).
        kv_indptr: int32 CPU ``[R + 1]``, cumulative page counts.
        kv_last_page_len: int32 CPU ``[R]``, tokens in each request's last page (1..block_size;
            1 for padding requests, which have no pages).
        page_rows: int64 ``[kv_indptr[-1]]``, for every page the flat index
            ``request * table_width + page`` into the row-major block table (a numpy array
            from :func:`paged_kv_layout`; the backend moves all four into pinned CPU tensors).
    """

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_last_page_len: torch.Tensor
    page_rows: np.ndarray | torch.Tensor


def paged_kv_layout(
    query_lens: list[int],
    seq_lens: list[int],
    block_size: int,
    table_width: int,
    num_padding_reqs: int = 0,
) -> PagedKVLayout:
    """CSR page layout of a batch from host lengths (pure host work).

    Args:
        query_lens / seq_lens: new tokens and KV length (after this step) of each request.
        block_size: tokens per page.
        table_width: columns of the block table (``max_blocks_per_seq``).
        num_padding_reqs: empty requests appended to fill a CUDA-graph bucket: no pages and
            ``last_page_len`` 1 (flashinfer reads 0 as a full page), so the kernel sees length 0.

    Raises:
        ValueError: a sequence shorter than 1 or than its query, or longer than the block table.
    """
    n = len(seq_lens)
    if n <= SMALL_BATCH and len(query_lens) == n:
        return _small_layout(query_lens, seq_lens, block_size, table_width, num_padding_reqs)
    q = np.asarray(query_lens, dtype=np.int64)
    s = np.asarray(seq_lens, dtype=np.int64)
    pages = (s + block_size - 1) // block_size
    if len(q) != n or (n and (s.min() < 1 or q.min() < 0 or (q > s).any())):
        raise _bad_lengths(q.tolist(), s.tolist())
    if n and pages.max() > table_width:
        raise _too_many_blocks(int(s.max()), int(pages.max()), table_width)
    total = n + num_padding_reqs
    qo_indptr = np.zeros(total + 1, dtype=np.int32)
    qo_indptr[1 : n + 1] = np.cumsum(q)
    qo_indptr[n + 1 :] = qo_indptr[n]
    kv_indptr = np.zeros(total + 1, dtype=np.int32)
    kv_indptr[1 : n + 1] = np.cumsum(pages)
    kv_indptr[n + 1 :] = kv_indptr[n]
    last = np.ones(total, dtype=np.int32)
    last[:n] = s - (pages - 1) * block_size
    req = np.repeat(np.arange(n, dtype=np.int64), pages)
    page_rows = req * table_width + (np.arange(req.size, dtype=np.int64) - kv_indptr[req])
    return PagedKVLayout(
        torch.from_numpy(qo_indptr), torch.from_numpy(kv_indptr), torch.from_numpy(last), page_rows
    )


def _bad_lengths(query_lens: list[int], seq_lens: list[int]) -> ValueError:
    return ValueError(
        f"need 1 <= seq_len and 0 <= query_len <= seq_len; got query_lens={query_lens}, "
        f"seq_lens={seq_lens}"
    )


def _too_many_blocks(seq_len: int, blocks: int, table_width: int) -> ValueError:
    return ValueError(
        f"a sequence of {seq_len} tokens needs {blocks} blocks, more than the block table's "
        f"{table_width}"
    )


def _check_lengths(query_lens, seq_lens, pages, table_width: int) -> None:
    """The checks of :func:`paged_kv_layout` on Python lists (raises its ValueErrors)."""
    if any(s < 1 or q < 0 or q > s for q, s in zip(query_lens, seq_lens)):
        raise _bad_lengths(list(query_lens), list(seq_lens))
    if pages and max(pages) > table_width:
        raise _too_many_blocks(max(seq_lens), max(pages), table_width)


def _small_layout(
    query_lens, seq_lens, block_size: int, table_width: int, num_padding_reqs: int
) -> PagedKVLayout:
    """:func:`paged_kv_layout` with Python lists, for a few requests (:data:`SMALL_BATCH`)."""
    pages = [(s + block_size - 1) // block_size for s in seq_lens]
    _check_lengths(query_lens, seq_lens, pages, table_width)
    qo_indptr, kv_indptr = [0], [0]
    qo_indptr += accumulate(query_lens)
    kv_indptr += accumulate(pages)
    last = [s - (p - 1) * block_size for s, p in zip(seq_lens, pages)]
    if num_padding_reqs:
        qo_indptr += [qo_indptr[-1]] * num_padding_reqs
        kv_indptr += [kv_indptr[-1]] * num_padding_reqs
        last += [1] * num_padding_reqs
    rows = [r * table_width + j for r, p in enumerate(pages) for j in range(p)]
    # numpy, then a shared tensor: a third of torch.tensor's time on a list (0.8 against 2.5 us).
    return PagedKVLayout(
        torch.from_numpy(np.array(qo_indptr, dtype=np.int32)),
        torch.from_numpy(np.array(kv_indptr, dtype=np.int32)),
        torch.from_numpy(np.array(last, dtype=np.int32)),
        np.array(rows, dtype=np.int64),
    )
