"""The tensor-parallel group of one rank.

Each rank is one process. Collectives on tensors run on the device group (NCCL on CUDA, gloo on
CPU); control messages (the step broadcast from rank 0) run on a gloo group over host memory, so
they never touch the device or sync it. The group is passed to whoever needs it (layers, the
worker); it is not a module global.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist

from fastdeploy.config import check
from fastdeploy.platforms import get_platform


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


class FusedAllReduce(Protocol):
    """What the group carries of a fused all-reduce + residual add + RMSNorm: the interface
    :class:`~fastdeploy.model_executor.layers.allreduce_fusion.AllReduceFusion` implements.
    Declared here so that ``distributed`` ranks below ``model_executor`` and never imports it.
    """

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor, norm: torch.nn.Module
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(s), s)`` with ``s = all_reduce(x) + residual``; ``x``, ``residual``:
        ``[T, hidden]`` of one dtype; ``norm``: an RMSNorm (``weight``, ``eps``)."""
        ...

    def destroy(self) -> None:
        """Free the workspace (collective: every rank calls it)."""
        ...


@dataclass(frozen=True)
class TPGroup:
    """One rank's view of the tensor-parallel group.

    Attributes:
        rank: this rank (0 runs the scheduler).
        world_size: ranks in the group (``--tensor-parallel-size``).
        device_group: process group for tensor collectives (NCCL on CUDA, gloo on CPU).
        cpu_group: gloo group for control messages.
        allreduce_fusion: the fused all-reduce + residual add + RMSNorm with its workspace, when
            the graph plan turned it on (rule 9); the dense decoder's row-parallel outputs then
            go through it instead of :func:`all_reduce`. Set by the worker before the model is
            built (``dataclasses.replace``).
    """

    rank: int
    world_size: int
    device_group: object
    cpu_group: object
    allreduce_fusion: FusedAllReduce | None = None

    @property
    def is_driver(self) -> bool:
        """Rank 0: runs the scheduler and sends each step to the others."""
        return self.rank == 0


#: Store key each rank increments once it reached the rendezvous.
_JOINED_KEY = "fastdeploy/tp_joined"
#: Limit of the control group's collectives. A rank waits there for rank 0's next step for as long
#: as the engine stays idle, so this is "forever"; a dead peer still ends the wait at once (its
#: sockets close), and the device group keeps the real ``timeout_s``.
CONTROL_TIMEOUT = datetime.timedelta(days=365)


def init_tp_group(
    rank: int,
    world_size: int,
    dist_init_addr: str,
    device_type: str,
    timeout_s: float = 600.0,
    wait_poll: Callable[[], None] | None = None,
) -> TPGroup:
    """Join the group (every rank calls this with the same address and world size).

    Rank 0 hosts the rendezvous store at ``dist_init_addr``. While it waits for the other ranks
    it calls ``wait_poll()`` every 50 ms, so a rank process that died before joining is reported
    at once (``wait_poll`` raises) instead of after ``timeout_s``.

    Args:
        rank: global rank, ``node_rank * ranks_per_node + local_rank``.
        world_size: ranks in all.
        dist_init_addr: ``host:port`` of rank 0's rendezvous store.
        device_type: ``cuda`` (NCCL) or ``cpu`` (gloo).
        timeout_s: limit of the rendezvous and of every device collective.
        wait_poll: rank 0 only: called while waiting for the other ranks; raises to give up.

    Raises:
        ValueError: a bad address, rank or device type.
        TimeoutError: not every rank joined within ``timeout_s``.
        RuntimeError / DistNetworkError: the rendezvous failed (from ``torch.distributed``).
    """
    host, port = parse_dist_init_addr(dist_init_addr)
    check(
        isinstance(world_size, int) and world_size >= 1, "tensor_parallel_size", world_size, ">= 1"
    )
    check(0 <= rank < world_size, "rank", rank, f"0..{world_size - 1}")
    check(device_type in ("cuda", "cpu"), "device", device_type, "cuda or cpu")
    backend = get_platform(device_type).collective_backend
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(
        host, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False
    )
    store.add(_JOINED_KEY, 1)
    if rank == 0:
        _wait_for_ranks(store, world_size, timeout_s, wait_poll)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    device_group = dist.group.WORLD
    # Control messages get a gloo group of their own (also on CPU, where the device group is
    # gloo too), because their wait is unbounded while the device group's is not.
    cpu_group = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return TPGroup(rank, world_size, device_group, cpu_group)


def _wait_for_ranks(
    store: dist.Store, world_size: int, timeout_s: float, poll: Callable[[], None] | None
) -> None:
    deadline = time.monotonic() + timeout_s
    while (joined := store.add(_JOINED_KEY, 0)) < world_size:
        if poll is not None:
            poll()
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"only {joined} of {world_size} tensor-parallel ranks joined within {timeout_s:g} s"
            )
        time.sleep(0.05)


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


def warm_up_collectives(tp: TPGroup, largest: tuple[int, int], dtype: torch.dtype) -> None:
    """Run the device collectives of a step once on CUDA, at one element and at ``largest``
    (``[tokens, hidden]`` of the largest step), then free the tensors.

    NCCL creates its communicator and connects its buffers at a collective's first use; doing
    that here, before the model loads, (1) puts that memory outside PyTorch's allocator before
    the KV cache is sized, where the budget counts it as non-PyTorch memory instead of missing it,
    and (2) keeps the first use out of a CUDA graph capture. A no-op on CPU or with one rank.
    """
    if tp.world_size == 1 or dist.get_backend(tp.device_group) != "nccl":
        return
    device = torch.device("cuda", torch.cuda.current_device())
    small = torch.ones(1, 1, dtype=dtype, device=device)
    all_reduce(small, tp)
    all_gather_last_dim(small, tp)
    all_reduce(torch.zeros(largest, dtype=dtype, device=device), tp)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def all_gather_last_dim(x: torch.Tensor, tp: TPGroup | None) -> torch.Tensor:
    """Concatenate every rank's ``x [..., n]`` along the last dim -> ``[..., n * world_size]`` in
    rank order (vocab-parallel logits)."""
    if tp is None or tp.world_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp.world_size)]
    dist.all_gather(parts, x.contiguous(), group=tp.device_group)
    return torch.cat(parts, dim=-1)


#: Bytes of the first broadcast of every step message (:func:`broadcast_step`): a length header
#: and the start of the pickle. A decode step of 64 requests pickles to about 20 KB, so almost
#: every step is one collective; a longer message takes a second one for the rest.
STEP_HEADER_BYTES = 32768
_LEN_BYTES = 8


def broadcast_step(obj: object, tp: TPGroup) -> object:
    """Rank 0 sends ``obj`` (a step's scheduler output, picklable) and returns it; the other ranks
    pass anything and get rank 0's. Runs on the gloo control group.

    One broadcast of a fixed :data:`STEP_HEADER_BYTES` buffer carries the pickle's length and
    its first bytes, and a second one only the rest of a longer pickle: two collectives at most,
    against ``broadcast_object_list``'s two every time plus its per-call tensor conversions
    (measured on a 2-core host: 122 us against 715 us per decode step of one request).
    """
    import pickle

    cap = STEP_HEADER_BYTES - _LEN_BYTES
    head = torch.zeros(STEP_HEADER_BYTES, dtype=torch.uint8)
    view = head.numpy()
    data = b""
    if tp.is_driver:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        view[:_LEN_BYTES] = np.frombuffer(len(data).to_bytes(_LEN_BYTES, "little"), np.uint8)
        first = min(len(data), cap)
        view[_LEN_BYTES : _LEN_BYTES + first] = np.frombuffer(data, np.uint8, count=first)
    dist.broadcast(head, src=0, group=tp.cpu_group)
    size = int.from_bytes(view[:_LEN_BYTES].tobytes(), "little")
    tail = None
    if size > cap:
        tail = torch.zeros(size - cap, dtype=torch.uint8)
        if tp.is_driver:
            tail.numpy()[:] = np.frombuffer(data, np.uint8, offset=cap)
        dist.broadcast(tail, src=0, group=tp.cpu_group)
    if tp.is_driver:
        return obj
    body = view[_LEN_BYTES : _LEN_BYTES + min(size, cap)].tobytes()
    if tail is not None:
        body += tail.numpy().tobytes()
    return pickle.loads(body)


def min_over_ranks(value: int, tp: TPGroup | None) -> int:
    """The smallest ``value`` of all ranks (every rank calls it; on the control group, host
    memory). ``value`` itself without a group."""
    if tp is None or tp.world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=tp.cpu_group)
    return int(t.item())


def abort_tp_group() -> None:
    """Abort the default group from another thread, so that a collective blocked on a dead peer
    returns with an error (NCCL waits on the device and never notices a closed socket; gloo
    does). Best effort: a no-op when nothing is initialised or the call is unavailable."""
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is not None and dist.is_initialized():
        try:
            abort()
        except Exception:  # noqa: BLE001 - the caller raises the real error (the dead rank)
            pass
