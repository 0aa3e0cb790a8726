"""The fused all-reduce + residual add + RMSNorm of tensor parallelism.

In a dense decoder every row-parallel linear (``o_proj``, ``down_proj``) is followed by an
all-reduce, the residual add and an RMSNorm (the post-attention norm, the next layer's input norm
or the final norm). With ``enable_flashinfer_allreduce_fusion`` the linear leaves its partial sum
unreduced and one kernel does the three: flashinfer's ``trtllm_allreduce_fusion`` with pattern
``kARResidualRMSNorm`` (TensorRT-LLM's allReduceFusion kernels: each rank writes its partial sum
into its peers' buffers through CUDA IPC, then every rank sums, adds the residual and normalises
in one pass) instead of an NCCL all-reduce and two elementwise kernels.

The kernel needs an IPC workspace on every rank, allocated collectively once and sized for a
largest token count (:meth:`AllReduceFusion.create`). The graph policy (rule 9) sizes it for the
largest step the engine can run, the larger of ``max_num_batched_tokens`` and the largest
prefill bucket, so that every step takes the fused path; a larger step would fall back to NCCL
all-reduce + RMSNorm (:meth:`AllReduceFusion.__call__`).

Measured on 2x H200 with flashinfer 0.5.3 (bf16, hidden 4096): outputs within 0.0625 of NCCL
all-reduce + fp32 RMSNorm for 1-8,192 tokens, eager and inside a CUDA graph; a graph replay of the
fused op takes 5 us at 16 tokens and 107 us at 8,192; the first use JIT-builds flashinfer's comm
module (144 s on a fresh host).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import io
import logging
from collections.abc import Callable

import torch
import torch.distributed as dist

from fastdeploy.distributed.parallel_state import TPGroup, all_reduce
from fastdeploy.model_executor.layers.normalization import RMSNorm

logger = logging.getLogger(__name__)

#: ``flashinfer.comm.AllReduceFusionPattern.kARResidualRMSNorm``: all-reduce, residual add, RMSNorm.
AR_RESIDUAL_RMSNORM = 1
#: Group sizes flashinfer 0.5.3 picks a one-shot/two-shot strategy for (its
#: ``_use_oneshot_heuristics`` table); other sizes raise inside the op.
FUSION_WORLD_SIZES = (2, 4, 8)
_ALIGN = 1 << 21  # flashinfer rounds every IPC buffer up to 2 MiB
_MAX_COMM_SIZE = 2147483647 & ~(_ALIGN - 1)  # flashinfer's cap of one Lamport buffer
_BARRIER_FLAGS = 256  # flashinfer's BarrierFlagCount


def fusion_unavailable() -> str | None:
    """Why flashinfer's fused all-reduce cannot run in this environment; None when it can.

    Imports ``flashinfer.comm`` (which loads the CUDA runtime, nothing is compiled here) and checks
    for the functions used below.
    """
    if importlib.util.find_spec("flashinfer") is None:
        return "flashinfer is not installed"
    try:
        import flashinfer.comm as comm
    except Exception as e:  # noqa: BLE001 - any import failure means "not available", with why
        return f"flashinfer.comm does not import ({type(e).__name__}: {e})"
    for name in (
        "trtllm_allreduce_fusion",
        "trtllm_create_ipc_workspace_for_all_reduce_fusion",
        "trtllm_destroy_ipc_workspace_for_all_reduce_fusion",
    ):
        if not hasattr(comm, name):
            return f"this flashinfer has no flashinfer.comm.{name}"
    return None


def workspace_bytes(world_size: int, max_token_num: int, hidden_size: int, elem: int = 2) -> int:
    """Device bytes of one rank's fusion workspace, as flashinfer 0.5.3 allocates it (a data
    buffer, barrier flags and three Lamport buffers, each rounded up to 2 MiB); ``elem`` is 4 for
    float32 activations."""

    def aligned(n: int) -> int:
        return -(-n // _ALIGN) * _ALIGN

    data = world_size * max_token_num * hidden_size * 2
    lamport = min(world_size * max_token_num * hidden_size * elem, _MAX_COMM_SIZE)
    return aligned(data) + aligned(world_size * _BARRIER_FLAGS * 4) + aligned(3 * lamport)


class AllReduceFusion:
    """One rank's fused ``all_reduce(x) + residual -> RMSNorm`` and its workspace.

    Build it with :meth:`create` (every rank at the same point: the workspace is exchanged between
    the ranks); tests pass a stand-in ``op``.

    Args:
        tp: the tensor-parallel group.
        max_token_num: most tokens one call may carry (the workspace's size).
        hidden_size: the hidden size the workspace was made for.
        op: the fused op with the keyword signature of ``flashinfer.comm.trtllm_allreduce_fusion``.
        workspace: int64 device tensor of the IPC pointers (None with a stand-in op).
        metadata: flashinfer's workspace metadata; the op checks every call against it.
        ipc_handles: the pointers of the three IPC buffers on every rank (``[buffer][rank]``),
            for :meth:`destroy`.

    Attributes:
        num_fused, num_fallback: calls that took each path; counted when Python runs the call
            (eager steps and graph capture), not at graph replay.
    """

    def __init__(
        self,
        tp: TPGroup,
        max_token_num: int,
        hidden_size: int,
        op: Callable[..., None],
        workspace: torch.Tensor | None = None,
        metadata: dict | None = None,
        ipc_handles: list[list[int]] | None = None,
    ) -> None:
        self.tp = tp
        self.max_token_num = max_token_num
        self.hidden_size = hidden_size
        self.op = op
        self.workspace = workspace
        self.metadata = metadata
        self._ipc_handles = ipc_handles
        self.num_fused = 0
        self.num_fallback = 0

    @classmethod
    def create(
        cls, tp: TPGroup, max_token_num: int, hidden_size: int, dtype: torch.dtype
    ) -> AllReduceFusion:
        """Allocate this rank's IPC workspace and open its peers' (collective on
        ``tp.cpu_group``: every rank calls it at the same point, before any graph is captured).

        The first call on a host JIT-builds flashinfer's comm module (minutes). The buffers come
        from ``cudaMalloc``, outside PyTorch's allocator: they exist before the KV cache is
        sized, which counts them as non-PyTorch memory.

        Args:
            tp: the group (its ranks on one host: CUDA IPC).
            max_token_num: the largest step, in tokens.
            hidden_size: the model's hidden size.
            dtype: the activation dtype (float32 takes a float32 Lamport buffer).

        Raises:
            ValueError: a group size other than 2, 4 or 8.
            RuntimeError: from flashinfer or the CUDA runtime.
        """
        if tp.world_size not in FUSION_WORLD_SIZES:
            raise ValueError(
                f"tensor_parallel_size={tp.world_size} is invalid for the fused all-reduce; "
                f"allowed: {', '.join(map(str, FUSION_WORLD_SIZES))}"
            )
        import flashinfer.comm as comm

        if comm.AllReduceFusionPattern.kARResidualRMSNorm != AR_RESIDUAL_RMSNORM:
            raise RuntimeError("flashinfer's kARResidualRMSNorm code changed; update this module")
        # flashinfer prints every pointer it allocates; the log line below says what matters.
        with contextlib.redirect_stdout(io.StringIO()):
            handles, workspace, metadata = comm.trtllm_create_ipc_workspace_for_all_reduce_fusion(
                tp.rank,
                tp.world_size,
                max_token_num,
                hidden_size,
                use_fp32_lamport=dtype == torch.float32,
                group=tp.cpu_group,
                create_metadata=True,
            )
        elem = 4 if dtype == torch.float32 else 2
        logger.info(
            "fused all-reduce + RMSNorm: rank %d workspace for %d tokens x %d, %.0f MiB",
            tp.rank,
            max_token_num,
            hidden_size,
            workspace_bytes(tp.world_size, max_token_num, hidden_size, elem) / 2**20,
        )
        return cls(
            tp, max_token_num, hidden_size, comm.trtllm_allreduce_fusion, workspace, metadata,
            handles,
        )  # fmt: skip

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(s), s)`` with ``s = all_reduce(x) + residual``.

        Args:
            x: this rank's partial sum ``[T, hidden]`` (a row-parallel output left unreduced).
            residual: ``[T, hidden]``, the dtype of ``x``.
            norm: the RMSNorm whose weight and eps apply.

        Returns:
            new tensors ``[T, hidden]``; ``x`` may be overwritten. Steps of more than
            ``max_token_num`` tokens take NCCL all-reduce + :class:`RMSNorm` instead.
        """
        num_tokens = x.shape[0]
        if num_tokens > self.max_token_num:
            self.num_fallback += 1
            return norm(all_reduce(x, self.tp), residual)
        self.num_fused += 1
        x, residual = x.contiguous(), residual.contiguous()
        norm_out, residual_out = torch.empty_like(x), torch.empty_like(residual)
        self.op(
            allreduce_in=x,
            world_size=self.tp.world_size,
            world_rank=self.tp.rank,
            token_num=num_tokens,
            hidden_dim=x.shape[1],
            workspace_ptrs=self.workspace,
            launch_with_pdl=False,  # a plain launch: stream-ordered against its neighbours
            trigger_completion_at_end=True,
            fp32_acc=True,
            pattern_code=AR_RESIDUAL_RMSNORM,
            use_oneshot=None,  # flashinfer's heuristic by message size and group size
            allreduce_out=None,
            residual_in=residual,
            residual_out=residual_out,
            norm_out=norm_out,
            quant_out=None,
            scale_out=None,
            rms_gamma=norm.weight,
            rms_eps=norm.eps,
            scale_factor=None,
            layout_code=None,
            metadata=self.metadata,
        )
        return norm_out, residual_out

    def destroy(self) -> None:
        """Close the peers' buffers and free this rank's (collective: every rank calls it, after
        the graphs that use the workspace are released). A no-op with a stand-in op or twice."""
        handles, self._ipc_handles = self._ipc_handles, None
        if handles is None:
            return
        from flashinfer.comm import trtllm_destroy_ipc_workspace_for_all_reduce_fusion
        from flashinfer.comm.cuda_ipc import cudart

        torch.cuda.synchronize()
        # No peer may still be in a kernel that reads or writes these buffers.
        dist.barrier(group=self.tp.cpu_group)
        flag_ptr = int(self.workspace[-1].item())  # the 5-int32 state block flashinfer mallocs
        self.workspace = None
        close = cudart.lib.cudaIpcCloseMemHandle
        close.argtypes = [ctypes.c_void_p]
        for pointers in handles:
            for rank, ptr in enumerate(pointers):
                if rank != self.tp.rank:
                    close(ctypes.c_void_p(ptr))
        cudart.cudaFree(ctypes.c_void_p(flag_ptr))
        trtllm_destroy_ipc_workspace_for_all_reduce_fusion(handles, group=self.tp.cpu_group)
