"""The tensor-parallel group of one rank.

Each rank is one process. Collectives on tensors run on the device group (NCCL on CUDA, gloo on
CPU); control messages (the step broadcast from rank 0) run on a gloo group over host memory, so
they never touch the device or sync it. The group is passed to whoever needs it (layers, the
worker); it is not a module global.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fastdeploy.config import check


def parse_dist_init_addr(addr: str) -> tuple[str, int]:
    """``host:port`` -> ``(host, port)``.

    Raises:
        ValueError: not ``host:port`` with a port in 1..65535 (names the value).
    """
    host, _, port = addr.rpartition(":") if isinstance(addr, str) else ("", "", "")
    check(
        bool(host) and port.isdigit() and 0 < int(port) < 65536,
        "dist_init_addr",
        addr,
        "host:port, e.g. 127.0.0.1:29500",
    )
    return host, int(port)


@dataclass(frozen=True)
class TPGroup:
    """One rank's view of the tensor-parallel group.

    Attributes:
        rank: this rank (0 runs the scheduler).
        world_size: ranks in the group (``--tensor-parallel-size``).
        device_group: process group for tensor collectives (NCCL on CUDA, gloo on CPU).
        cpu_group: gloo group for control messages.
    """

    rank: int
    world_size: int
    device_group: object
    cpu_group: object

    @property
    def is_driver(self) -> bool:
        """Rank 0: runs the scheduler and sends each step to the others."""
        return self.rank == 0


def init_tp_group(
    rank: int,
    world_size: int,
    dist_init_addr: str,
    device_type: str,
    timeout_s: float = 600.0,
) -> TPGroup:
    """Join the group (every rank calls this with the same address and world size).

    Args:
        rank: global rank, ``node_rank * ranks_per_node + local_rank``.
        world_size: ranks in all.
        dist_init_addr: ``host:port`` of rank 0's rendezvous store.
        device_type: ``cuda`` (NCCL) or ``cpu`` (gloo).
        timeout_s: limit of the rendezvous and of every collective.

    Raises:
        ValueError: a bad address, rank or device type.
        RuntimeError / DistNetworkError: the rendezvous failed (from ``torch.distributed``).
    """
    host, port = parse_dist_init_addr(dist_init_addr)
    check(
        isinstance(world_size, int) and world_size >= 1, "tensor_parallel_size", world_size, ">= 1"
    )
    check(0 <= rank < world_size, "rank", rank, f"0..{world_size - 1}")
    check(device_type in ("cuda", "cpu"), "device", device_type, "cuda or cpu")
    backend = "nccl" if device_type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(
        backend,
        init_method=f"tcp://{host}:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )
    device_group = dist.group.WORLD
    cpu_group = (
        dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else device_group
    )
    return TPGroup(rank, world_size, device_group, cpu_group)


def destroy_tp_group() -> None:
    """Leave the group (at shutdown; a no-op when none was joined)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce(x: torch.Tensor, tp: TPGroup | None) -> torch.Tensor:
    """Sum ``x`` over the group in place and return it (``x`` unchanged with one rank). Capturable
    in a CUDA graph with NCCL."""
    if tp is None or tp.world_size == 1:
        return x
    dist.all_reduce(x, group=tp.device_group)
    return x


def all_gather_last_dim(x: torch.Tensor, tp: TPGroup | None) -> torch.Tensor:
    """Concatenate every rank's ``x [..., n]`` along the last dim -> ``[..., n * world_size]`` in
    rank order (vocab-parallel logits)."""
    if tp is None or tp.world_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp.world_size)]
    dist.all_gather(parts, x.contiguous(), group=tp.device_group)
    return torch.cat(parts, dim=-1)


def broadcast_step(obj: object, tp: TPGroup) -> object:
    """Rank 0 sends ``obj`` (a step's scheduler output, picklable) and returns it; the other ranks
    pass anything and get rank 0's. Runs on the gloo control group."""
    box = [obj if tp.is_driver else None]
    dist.broadcast_object_list(box, src=0, group=tp.cpu_group)
    return box[0]
