"""The host KV tier's memory: one pinned host tensor per layer in the device cache's block layout,
and the block copies between the two on a side stream (``docs/pd-disaggregation.md``, "Host tier").

Because the layout is the device's, one block of one layer is one contiguous copy, and a run of
blocks that are consecutive on both sides is one copy too (``merge_block_runs``). On CUDA the host
memory is pinned, copies are ``non_blocking`` on a side stream that first waits for the compute
stream, and a copy job ends with a CUDA event (one per layer for a layer-by-layer swap-in), so
nobody syncs the host. On CPU (tests, CI) copies are plain and done at once.

The host tensors are pinned with ``cudaHostRegister`` rather than ``pin_memory=True``: PyTorch's
pinned-memory allocator rounds every allocation up to a power of two, which would lock up to twice
the ``--swap-space`` that was asked for.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from fastdeploy.cache_manager.block_runs import merge_block_runs

GiB = 1 << 30


def host_memory_bytes() -> int:
    """Physical memory of this host in bytes."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def host_blocks_for(swap_space_gib: float, bytes_per_block: int) -> int:
    """Host blocks that ``--swap-space`` GiB hold (every layer of a block counted).

    Raises:
        ValueError: the request exceeds this host's memory (the message names both), or holds
            no block.
    """
    wanted = int(swap_space_gib * GiB)
    total = host_memory_bytes()
    if wanted >= total:
        raise ValueError(
            f"swap_space={swap_space_gib:g} GiB is invalid; allowed: less than this host's "
            f"{total / GiB:.1f} GiB of memory (and leave room for the process)"
        )
    n = wanted // bytes_per_block
    if n < 1:
        raise ValueError(
            f"swap_space={swap_space_gib:g} GiB holds no KV block of {bytes_per_block} bytes; "
            "allowed: at least one block"
        )
    return n


@dataclass
class CopyJob:
    """Copies in flight: ``events`` (one per layer, or one for all) complete in order.

    On CPU there are no events: the copies were done before the job was returned.
    """

    events: list = field(default_factory=list)

    def done(self) -> bool:
        """Every copy landed (no host sync: ``Event.query``)."""
        return all(e.query() for e in self.events)

    def wait_on(self, stream) -> None:
        """Make ``stream`` wait for every copy (a device-side wait, no host sync)."""
        for e in self.events:
            stream.wait_event(e)


def _register(tensor: torch.Tensor) -> None:
    """Page-lock ``tensor``'s memory for asynchronous copies (exactly its bytes).

    Raises:
        RuntimeError: CUDA refused (names the size and the error).
    """
    nbytes = tensor.numel() * tensor.element_size()
    err = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(
            f"pinning {nbytes / GiB:.2f} GiB of host memory for the host KV tier failed "
            f"(cudaHostRegister error {int(err)}); lower --swap-space"
        )


def _unregister(pointers: list[int]) -> None:
    cudart = torch.cuda.cudart()
    while pointers:
        cudart.cudaHostUnregister(pointers.pop())


class HostKVPool:
    """Host copies of KV blocks.

    Args:
        num_blocks: host blocks (see :func:`host_blocks_for`).
        block_shape: the shape of one block of one layer (``kv_cache.shape[1:]``).
        num_layers: layers (one host tensor each).
        dtype: the KV dtype.
        device: the device of the KV caches (pinned host memory and a side stream on CUDA).
    """

    def __init__(
        self,
        num_blocks: int,
        block_shape: Sequence[int],
        num_layers: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        shape = (num_blocks, *block_shape)
        self.layers = [torch.empty(shape, dtype=dtype) for _ in range(num_layers)]
        self.stream = torch.cuda.Stream(self.device) if cuda else None
        self._release = None
        if cuda:
            registered = []
            self._release = weakref.finalize(self, _unregister, registered)
            for layer in self.layers:
                _register(layer)
                registered.append(layer.data_ptr())

    def release(self) -> None:
        """Unpin the host memory (CUDA); the pool must not be used afterwards. Idempotent, and
        also done when the pool is garbage collected."""
        if self._release is not None:
            self.stream.synchronize()  # no copy may still read or write the memory
            self._release()

    @property
    def num_blocks(self) -> int:
        return self.layers[0].shape[0]

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block over all layers."""
        layer = self.layers[0]
        return layer[0].numel() * layer.element_size() * len(self.layers)

    def _copy(self, dst, src, runs, events_per_layer: bool) -> CopyJob:
        if self.stream is None:
            for d, s in zip(dst, src):
                for first_s, first_d, n in runs:
                    d[first_d : first_d + n].copy_(s[first_s : first_s + n])
            return CopyJob()
        job = CopyJob()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for d, s in zip(dst, src):
                for first_s, first_d, n in runs:
                    d[first_d : first_d + n].copy_(s[first_s : first_s + n], non_blocking=True)
                if events_per_layer:
                    job.events.append(self.stream.record_event())
            if not events_per_layer:
                job.events.append(self.stream.record_event())
        return job

    def store(
        self,
        kv_caches: list[torch.Tensor],
        device_blocks: Sequence[int],
        host_blocks: Sequence[int],
    ) -> CopyJob:
        """Copy ``device_blocks`` of every layer into ``host_blocks`` (write-through). The caller
        keeps the device blocks pinned and the host blocks unpublished until the job is done."""
        return self._copy(
            self.layers, kv_caches, merge_block_runs(device_blocks, host_blocks), False
        )

    def load(
        self,
        kv_caches: list[torch.Tensor],
        host_blocks: Sequence[int],
        device_blocks: Sequence[int],
        per_layer: bool = False,
    ) -> CopyJob:
        """Copy ``host_blocks`` into ``device_blocks`` of every layer (swap-in). With
        ``per_layer`` the job has one event per layer, in layer order, for attention to wait on
        before it reads that layer."""
        return self._copy(
            kv_caches, self.layers, merge_block_runs(host_blocks, device_blocks), per_layer
        )
