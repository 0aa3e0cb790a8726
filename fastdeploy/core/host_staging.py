"""Pinned host buffers that per-step data goes through on its way to the device.

A step's host data (token ids, positions, block tables, sampling rows, ...) is written into a
pinned host buffer and copied with ``non_blocking=True``: the copy is queued on the stream and
the host goes on at once (from pageable memory the driver stages the copy itself and can wait for
the stream). The host must then not overwrite that buffer before the copy ran. Under the overlap
schedule the host prepares step N+1 while the device may not have reached step N's copies yet,
so each owner keeps two sets and alternates: a set is refilled only after the copies that last
read it (two fills back) ran, which an event per set checks, waiting if they have not. In the
engine's step loop with sampled tokens the host has already waited for that step, whose copies
come earlier in the stream, so the check costs nothing; a rank other than 0 under tensor
parallelism, steps without sampled rows and capture loops can wait there.

On CPU there is one set and no event: a copy is done when ``copy_`` returns.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TypeVar

import torch

V = TypeVar("V")

#: Most streams :func:`current_stream` remembers before it starts over.
MAX_CACHED_STREAMS = 64

_streams: dict[tuple[int, int], torch.cuda.Stream] = {}


def remember(cache: dict, key: Hashable, value: V, limit: int) -> V:
    """Store ``value`` under ``key`` in ``cache`` and return it, first emptying ``cache`` when it
    already holds ``limit`` entries: the bound of the per-shape memos of the step's host path
    (tensor views, streams), whose entries are cheap to make again. Callers look up with
    ``cache.get(key)`` themselves, so a hit costs one dict lookup."""
    if len(cache) >= limit:
        cache.clear()
    cache[key] = value
    return value


def current_stream() -> torch.cuda.Stream:
    """``torch.cuda.current_stream()`` of the current device, remembered per raw stream handle.

    ``torch.cuda.current_stream()`` resolves the device in Python (``is_available``, the
    ``PYTORCH_NVML_BASED_CUDA_CHECK`` variable, ``current_device``) and builds a new ``Stream``
    under a device guard on every call; a 16-token prefill step records four events, and each
    record took 37 us under cProfile on an H200 host (its ten Python calls inflated by the
    profiler; unprofiled, a few microseconds each). Here
    a C call reads the current device and the raw handle of its current stream, and the
    ``Stream`` object built the first time for that pair is reused: a handle always belongs to
    the same stream (torch's pooled streams live as long as the process; an external stream's
    id is its handle).
    """
    index = torch._C._cuda_getDevice()
    key = (index, torch._C._cuda_getCurrentRawStream(index))
    stream = _streams.get(key)
    if stream is None:
        stream = remember(_streams, key, torch.cuda.current_stream(index), MAX_CACHED_STREAMS)
    return stream


def record_event(event: torch.cuda.Event) -> None:
    """``event.record()`` on the current stream, without :func:`torch.cuda.current_stream`'s
    Python overhead (see :func:`current_stream`)."""
    event.record(current_stream())


class StagingSets:
    """Owner of the pinned host buffers of one component (see the module docstring).

    Args:
        specs: buffer name -> ``(shape, dtype)``; every set holds one tensor per name.
        device: the device the buffers are copied to; pinned (and doubled) only on CUDA.
    """

    def __init__(self, specs: dict[str, tuple[tuple[int, ...], torch.dtype]], device: torch.device):
        self.is_async = device.type == "cuda"
        num_sets = 2 if self.is_async else 1
        self._sets = [
            {
                name: torch.zeros(shape, dtype=dtype, pin_memory=self.is_async)
                for name, (shape, dtype) in specs.items()
            }
            for _ in range(num_sets)
        ]
        self._events: list[torch.cuda.Event | None] = [None] * num_sets
        self._index = 0

    def capacity(self, name: str) -> int:
        """Elements of buffer ``name`` in each set."""
        return self._sets[0][name].numel()

    def next(self) -> dict[str, torch.Tensor]:
        """The set to fill for the next copies: the other one than last time, once the copies
        that last read it have run (see the module docstring)."""
        if self.is_async:
            self._index ^= 1
            event = self._events[self._index]
            if event is not None and not event.query():
                event.synchronize()
        return self._sets[self._index]

    def current(self) -> dict[str, torch.Tensor]:
        """The set :meth:`next` last returned."""
        return self._sets[self._index]

    def copies_queued(self) -> None:
        """Mark the copies out of the current set as queued on the current stream."""
        if self.is_async:
            event = self._events[self._index]
            if event is None:
                event = self._events[self._index] = torch.cuda.Event()
            record_event(event)


def to_device_async(array, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host array (list or numpy) as a new ``dtype`` tensor on ``device``, copied without a
    host sync: on CUDA through pinned memory of torch's caching host allocator, which keeps the
    block until the copy ran. For data written once per request (its sampling parameters and
    masks, at its first sampled token), not per step."""
    host = torch.as_tensor(array, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


#: Byte alignment of each buffer inside a :class:`PackedBuffers` allocation (a multiple of
#: every dtype's size, and of the 16 bytes vectorized kernels may assume).
PACK_ALIGN = 256

#: Unused bytes between two used ranges that :meth:`PackedBuffers.upload` copies along rather
#: than queueing a second copy: 64 KiB take about 1.3 us at the ~50 GB/s of a pinned copy on an
#: H200 host, against about 10 us of host time for one more ``copy_``.
MERGE_GAP_BYTES = 64 * 1024


class PackedBuffers:
    """Persistent 1-D device buffers laid out in one device allocation and filled from one
    pinned host allocation per staging set, so a step uploads them with one copy, or a few.

    A step's inputs are several small buffers (token ids, positions, slot mapping, query start
    locations, ...); a ``copy_`` each costs about 10 us of host time on an H200 host (torch's
    dispatch plus ``cudaMemcpyAsync``). :meth:`upload` copies the used part of each buffer,
    merging neighbouring parts whose gap is at most :data:`MERGE_GAP_BYTES` into one copy: the
    gap's bytes are copied as they are in the host set (stale but never read: every reader is
    bounded by the step's own counts). Buffers sized for a large step (``max_num_tokens`` of
    tens of thousands) thus cost a few copies at a small step, never megabytes.

    Args:
        specs: buffer name -> ``(numel, dtype)``, in layout order: neighbours used together
            merge into one copy.
        device: where the buffers live (pinned, double-buffered staging on CUDA; see
            :class:`StagingSets`).

    Attributes:
        device_views: name -> the buffer on ``device`` (a view of the one allocation; its
            address never changes, so CUDA graphs may capture it).
        staging: the :class:`StagingSets` of the host allocation.
    """

    def __init__(self, specs: dict[str, tuple[int, torch.dtype]], device: torch.device) -> None:
        self._layout: dict[str, tuple[int, int, torch.dtype]] = {}
        offset = 0
        for name, (numel, dtype) in specs.items():
            offset = -(-offset // PACK_ALIGN) * PACK_ALIGN
            self._layout[name] = (offset, numel, dtype)
            offset += numel * dtype.itemsize
        self.nbytes = offset
        self._device = torch.zeros(offset, dtype=torch.uint8, device=device)
        self.device_views = self._views(self._device)
        self.staging = StagingSets({"packed": ((offset,), torch.uint8)}, device)
        self._host_views: dict[int, dict[str, torch.Tensor]] = {}

    def _views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        return {
            name: flat[off : off + numel * dtype.itemsize].view(dtype)
            for name, (off, numel, dtype) in self._layout.items()
        }

    def next(self) -> dict[str, torch.Tensor]:
        """Host views (name -> tensor on the host, pinned on CUDA) of the set to fill for the
        next :meth:`upload` (waits, rarely, as :meth:`StagingSets.next` does)."""
        flat = self.staging.next()["packed"]
        views = self._host_views.get(id(flat))
        if views is None:
            views = self._host_views[id(flat)] = self._views(flat)
        return views

    def ranges(self, used: dict[str, int]) -> list[tuple[int, int]]:
        """The byte ranges ``[start, end)`` :meth:`upload` copies for ``used`` (buffer name ->
        elements used from its start; buffers left out or at 0 are not copied).

        Raises:
            ValueError: a count outside ``0..capacity``, naming the buffer.
        """
        out: list[tuple[int, int]] = []
        for name, (offset, capacity, dtype) in self._layout.items():
            numel = used.get(name, 0)
            if not 0 <= numel <= capacity:
                raise ValueError(f"{numel} elements of {name!r}: allowed 0..{capacity}")
            if not numel:
                continue
            end = offset + numel * dtype.itemsize
            if out and offset - out[-1][1] <= MERGE_GAP_BYTES:
                out[-1] = (out[-1][0], end)
            else:
                out.append((offset, end))
        return out

    def upload(self, used: dict[str, int]) -> int:
        """Queue the copies of the current set's used parts to the device (no host wait on
        CUDA; see :meth:`ranges`). Returns the number of copies."""
        flat = self.staging.current()["packed"]
        spans = self.ranges(used)
        for start, end in spans:
            self._device[start:end].copy_(flat[start:end], non_blocking=True)
        self.staging.copies_queued()
        return len(spans)
