"""One scheduled step read into flat host lists: the per-request pass of
:meth:`~fastdeploy.worker.input_batch.InputBuffers.prepare`.

Each scheduled request is read once, in Python, into lists that cover the whole step (token ids,
sequence lengths, placeholder rows, sampling rows, the concatenated block tables); the caller
then writes them into its pinned buffers with a few whole-step numpy calls. A numpy call costs
about 1 us whatever its size, so one per request and buffer made up most of the input
preparation's host time at a large decode batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np

from fastdeploy.core.request import Request
from fastdeploy.core.scheduler_output import ScheduledRequest


@dataclass
class HostStep:
    """One step's host facts, in the step's request order (see :func:`gather_step`).

    Attributes:
        token_ids: the id of every token row, in layout order; 0 for a placeholder row.
        seq_lens: per request, its tokens after the step (``start + num_new_tokens``).
        fed_rows / fed_from: placeholder rows (overlap schedule), and the rows of the previous
            step's sampled tokens that hold their ids.
        sampling: indices of the requests that sample (``ScheduledRequest.samples``);
            ``sampling_reqs``: their ids.
        block_ids / num_blocks: the requests' block tables, concatenated, and their lengths.
    """

    token_ids: list[int]
    seq_lens: list[int]
    fed_rows: list[int]
    fed_from: list[int]
    sampling: list[int]
    sampling_reqs: list[str]
    block_ids: list[int]
    num_blocks: list[int]


def gather_step(reqs: list[ScheduledRequest], last_rows: dict[str, int] | None) -> HostStep:
    """Read every scheduled request of a step once.

    Args:
        reqs: the step's requests, in layout order.
        last_rows: request id -> row of the previous step's sampled tokens on the device
            (``LastSampled.rows``), or None when there is no such step.

    Raises:
        RuntimeError: a request with a token the host does not know other than its last one,
            or one whose placeholder the previous step did not sample (``last_rows``).
    """
    token_ids: list[int] = []
    fed_rows: list[int] = []
    fed_from: list[int] = []
    seq_lens: list[int] = []
    sampling: list[int] = []
    sampling_reqs: list[str] = []
    tables: list[list[int]] = []
    row = 0
    for i, s in enumerate(reqs):  # one pass, no per-request property chains: a hot loop
        request = s.request
        start = s.num_computed_tokens
        end = start + s.num_new_tokens
        known = request.num_tokens
        row += s.num_new_tokens
        seq_lens.append(end)
        tables.append(request.block_ids)
        if end == known + request.num_output_placeholders:  # ScheduledRequest.samples
            sampling.append(i)
            sampling_reqs.append(request.request_id)
        if end <= known:
            token_ids += token_slice(request, start, end)
            continue
        # The last token is a placeholder, fed on the device.
        if known > start:
            token_ids += token_slice(request, start, known)
        row_from = last_rows.get(request.request_id) if last_rows is not None else None
        if row_from is None or end - known != 1:
            raise _unknown_tokens(request.request_id, end - known)
        token_ids.append(0)
        fed_rows.append(row - 1)
        fed_from.append(row_from)
    return HostStep(
        token_ids=token_ids,
        seq_lens=seq_lens,
        fed_rows=fed_rows,
        fed_from=fed_from,
        sampling=sampling,
        sampling_reqs=sampling_reqs,
        block_ids=list(chain.from_iterable(tables)),
        num_blocks=[len(t) for t in tables],
    )


def fill_block_tables(
    tables: np.ndarray, block_ids: list[int], num_blocks: list[int], dirty: tuple[int, int]
) -> tuple[int, int]:
    """Write a step's concatenated block tables into the first rows of ``tables`` int32
    ``[max_num_reqs, max_blocks_per_seq]`` (row ``i`` gets the next ``num_blocks[i]`` ids of
    ``block_ids``, then zeros; rows past the step are zeros) with whole-step numpy calls.

    Only a corner of the array is touched: ``dirty = (rows, width)`` says that every cell
    outside ``tables[:rows, :width]`` is already zero (what the previous call on ``tables``
    returned; the array's shape for a new array). A decode batch's tables are a few dozen
    blocks wide in an array sized for ``max_num_seqs`` requests of ``max_model_len`` tokens, so
    this writes a fraction of it. The caller checked that every table fits a row.

    Returns:
        The new ``dirty``: the step's requests and its widest table.
    """
    num_reqs, width = len(num_blocks), max(num_blocks, default=0)
    tables[: max(num_reqs, dirty[0]), : max(width, dirty[1])] = 0
    if block_ids:
        # A boolean mask selects row-major, so its True cells take block_ids in order.
        lens = np.array(num_blocks, dtype=np.int64)
        rows = tables[:num_reqs, :width]
        rows[np.arange(width) < lens[:, None]] = block_ids
    return num_reqs, width


def token_positions(
    seq_lens: np.ndarray, query_lens: np.ndarray, cu: np.ndarray, decode_only: bool
) -> tuple[np.ndarray, np.ndarray]:
    """``(request index, position)`` of every token row of a step, int64 ``[num_tokens]`` each,
    from the requests' ``seq_lens`` and ``query_lens`` int64 ``[num_reqs]`` and ``cu``, the
    ``[num_reqs + 1]`` cumulative query lengths (row ``j`` of request ``i`` is at position
    ``seq_lens[i] - query_lens[i] + j - cu[i]``)."""
    if decode_only:  # row i is request i's only token
        return np.arange(len(seq_lens)), seq_lens - 1
    req_of_token = np.repeat(np.arange(len(seq_lens)), query_lens)
    positions = (seq_lens - query_lens - cu[:-1])[req_of_token] + np.arange(int(cu[-1]))
    return req_of_token, positions


def token_slice(request, start: int, end: int) -> list[int]:
    """Token ids ``start:end`` of prompt + output without building the concatenated list. A
    stand-in other than a :class:`Request` (a tensor-parallel rank's ``RankRequest``) carries
    only this step's tokens, ``step_token_ids``."""
    if not isinstance(request, Request):
        return request.step_token_ids
    n_prompt = len(request.prompt_token_ids)
    if end <= n_prompt:
        return request.prompt_token_ids[start:end]
    if start >= n_prompt:
        return request.output_token_ids[start - n_prompt : end - n_prompt]
    return request.prompt_token_ids[start:] + request.output_token_ids[: end - n_prompt]


def _unknown_tokens(request_id: str, num_unknown: int) -> RuntimeError:
    """The error of a request with ``num_unknown`` token ids the host does not know, where
    only its last one, sampled by the previous step, may be (a placeholder)."""
    return RuntimeError(
        f"request {request_id!r} needs {num_unknown} token id that the host does not know; "
        "allowed: its last token only, sampled by the previous step"
    )
