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

import torch


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

    def copies_queued(self) -> None:
        """Mark the copies out of the current set as queued on the current stream."""
        if self.is_async:
            event = self._events[self._index]
            if event is None:
                event = self._events[self._index] = torch.cuda.Event()
            event.record()


def to_device_async(array, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host array (list or numpy) as a new ``dtype`` tensor on ``device``, copied without a
    host sync: on CUDA through pinned memory of torch's caching host allocator, which keeps the
    block until the copy ran. For data written once per request (its sampling parameters and
    masks, at its first sampled token), not per step."""
    host = torch.as_tensor(array, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
