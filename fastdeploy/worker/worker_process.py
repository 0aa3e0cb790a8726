"""One tensor-parallel rank other than 0, in a process of its own.

Rank 0 (the engine's process, :class:`~fastdeploy.worker.executor.TensorParallelWorker`) sends
every worker call it makes, as a :class:`RankCall`, over the control group; each rank makes the
same call on its own :class:`~fastdeploy.worker.gpu_worker.GpuWorker`, so the collectives inside
(the all-reduces of the forward, the all-gather of the logits, the agreement on the block count)
meet in the same order on every rank. The ranks never sample: rank 0 alone does.

A rank exits when rank 0 says ``shutdown``, when any call fails (rank 0 then sees the rank die and
names it), when the engine's process is gone, and on SIGTERM (left at its default action: a
Python handler would not run while the rank waits inside a collective).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Any

from fastdeploy.config import DeploymentPlan, FDConfig
from fastdeploy.distributed.parallel_state import TPGroup, warm_up_collectives
from fastdeploy.model_executor.layers.allreduce_fusion import AllReduceFusion, workspace_bytes
from fastdeploy.worker.gpu_worker import GpuWorker, resolve_dtype

#: The worker methods rank 0 forwards, in the order the engine calls them (``execute_model`` once
#: per step), and ``shutdown``, which ends the loop.
RANK_METHODS = (
    "load_model",
    "determine_num_blocks",
    "initialize_kv_cache",
    "graph_optimize_and_warm_up_model",
    "execute_model",
    "shutdown",
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankCall:
    """One worker call rank 0 made, to be repeated on every rank.

    Attributes:
        method: one of :data:`RANK_METHODS`.
        args: its positional arguments (picklable; a step travels as
            :func:`~fastdeploy.worker.input_batch.rank_step` with rank 0's ``(mode, bucket)``).
    """

    method: str
    args: tuple = ()

    def __post_init__(self) -> None:
        if self.method not in RANK_METHODS:
            raise ValueError(
                f"method={self.method!r} is invalid; allowed: {', '.join(RANK_METHODS)}"
            )


def ranks_per_node(tensor_parallel_size: int, nnodes: int) -> int:
    """``tensor_parallel_size / nnodes``.

    Raises:
        ValueError: it does not divide (names both numbers).
    """
    if tensor_parallel_size % nnodes:
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} does not divide by nnodes={nnodes}; "
            f"allowed: a multiple of nnodes"
        )
    return tensor_parallel_size // nnodes


#: The call after which a rank has started (its heap is then frozen: ``core.gc_heap``).
WARMED_UP = GpuWorker.graph_optimize_and_warm_up_model.__name__


def run_rank(rank: int, dist_init_addr: str, config: Any) -> None:
    """The body of a rank process (module level, so that ``spawn`` can pickle it).

    The deployment plan comes from rank 0 right after the rendezvous (never re-derived here, also
    not on another node), so every rank captures the same buckets in the same order.

    Args:
        rank: global rank (>= 1); ``rank % ranks_per_node`` is the CUDA device index.
        dist_init_addr: rank 0's rendezvous ``host:port``.
        config: this node's ``FDConfig`` (the engine's, on node 0).
    """
    import torch

    from fastdeploy import envs
    from fastdeploy.core.gc_heap import freeze_startup_heap
    from fastdeploy.distributed.launcher import exit_with_parent
    from fastdeploy.distributed.parallel_state import (
        broadcast_step,
        destroy_tp_group,
        init_tp_group,
    )

    # Warnings and errors only (rank 0 logs the engine's progress), FD_LOG_LEVEL when set.
    logging.basicConfig(
        level=logging.WARNING, format=f"%(asctime)s rank {rank} %(levelname)s %(name)s: %(message)s"
    )
    envs.apply_log_level()
    exit_with_parent()
    parallel = config.parallel_config
    device_type = config.device_config.device
    local_ranks = ranks_per_node(parallel.tensor_parallel_size, parallel.nnodes)
    if device_type == "cuda":
        torch.cuda.set_device(rank % local_ranks)
    else:
        share_cpu_threads(local_ranks)
    tp = init_tp_group(rank, parallel.tensor_parallel_size, dist_init_addr, device_type)
    plan: DeploymentPlan = broadcast_step(None, tp)
    tp = setup_communication(tp, config, plan)
    worker = GpuWorker(config, plan.graph, tp=tp)
    # Any error propagates and ends the process (its traceback goes to this rank's log); rank 0
    # then finds the rank dead and names it.
    while True:
        call: RankCall = broadcast_step(None, tp)
        getattr(worker, call.method)(*call.args)
        if call.method == WARMED_UP:  # started, where rank 0's engine freezes its own heap
            freeze_startup_heap(f"rank {rank}", envs.FD_GC_FREEZE())
        if call.method == "shutdown":
            break
    release_communication(tp)
    destroy_tp_group()


def setup_communication(tp: TPGroup, config: FDConfig, plan: DeploymentPlan) -> TPGroup:
    """What every rank sets up between joining the group and building its worker, at the same
    point on every rank (rank 0 included), on CUDA: NCCL's communicator and buffers (one run of
    each collective, :func:`~fastdeploy.distributed.parallel_state.warm_up_collectives`) and,
    when the plan turned it on (rule 9), the fused all-reduce's IPC workspace, for the largest
    step, attached to the group the model is built with.

    Both live outside PyTorch's allocator and exist before the model loads, so the KV budget
    (``GpuWorker.determine_available_memory``: device memory in use that PyTorch did not
    reserve is taken out) counts them instead of running into them at the first step or capture.

    Returns:
        ``tp``, with ``allreduce_fusion`` set when the plan turned fusion on.
    """
    if config.device_config.device != "cuda" or tp.world_size == 1:
        return tp
    import torch

    hf = config.model_source.hf_config
    dtype = resolve_dtype(config.model_config.dtype, "cuda", hf)
    largest = max(
        [config.scheduler_config.max_num_batched_tokens, *plan.graph.prefill_capture_sizes]
    )
    free = torch.cuda.mem_get_info()[0]
    warm_up_collectives(tp, (largest, hf.hidden_size), dtype)
    nccl = max(free - torch.cuda.mem_get_info()[0], 0)  # 0 if the cache released more
    fusion = 0
    if plan.allreduce_fusion:
        max_tokens = plan.allreduce_fusion_max_tokens
        tp = dataclasses.replace(
            tp, allreduce_fusion=AllReduceFusion.create(tp, max_tokens, hf.hidden_size, dtype)
        )
        fusion = workspace_bytes(tp.world_size, max_tokens, hf.hidden_size, dtype.itemsize)
    logger.info(
        "rank %d communication buffers outside PyTorch: NCCL %.0f MiB, fused all-reduce "
        "workspace %.0f MiB (the KV budget counts both)",
        tp.rank,
        nccl / 2**20,
        fusion / 2**20,
    )
    return tp


def release_communication(tp: TPGroup) -> None:
    """Free the fused all-reduce's workspace (collective: at a clean shutdown, every rank after
    its worker released the graphs). Nothing to do without one."""
    if tp.allreduce_fusion is not None:
        tp.allreduce_fusion.destroy()


def share_cpu_threads(local_ranks: int) -> None:
    """On CPU, give each of this node's ranks an equal share of the cores for torch's intra-op
    threads; ranks that each take every core slow one another down."""
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_ranks))
