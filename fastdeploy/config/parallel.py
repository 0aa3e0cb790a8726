"""Tensor parallelism, the ranks' rendezvous and the node's splitwise role:
:class:`ParallelConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastdeploy.config.checks import check, check_int

SPLITWISE_ROLES = ("mixed", "prefill", "decode")


@dataclass
class ParallelConfig:
    """Tensor parallelism and prefill/decode disaggregation role.

    ``dist_init_addr`` (``host:port``) is where the ranks rendezvous (None: a free local port);
    ``nnodes`` and ``node_rank`` let the ranks span hosts. ``enable_flashinfer_allreduce_fusion``
    fuses the row-parallel all-reduce, residual add and next RMSNorm (CUDA, TP > 1).
    """

    tensor_parallel_size: int = 1
    splitwise_role: str = "mixed"
    dist_init_addr: str | None = None
    nnodes: int = 1
    node_rank: int = 0
    enable_flashinfer_allreduce_fusion: bool = False

    def __post_init__(self) -> None:
        check_int("tensor_parallel_size", self.tensor_parallel_size)
        check_int("nnodes", self.nnodes)
        check_int("node_rank", self.node_rank, minimum=0)
        check(self.node_rank < self.nnodes, "node_rank", self.node_rank, f"< nnodes={self.nnodes}")
        check(
            self.dist_init_addr is None
            or (isinstance(self.dist_init_addr, str) and ":" in self.dist_init_addr),
            "dist_init_addr",
            self.dist_init_addr,
            "host:port or null",
        )
        check(
            isinstance(self.enable_flashinfer_allreduce_fusion, bool),
            "enable_flashinfer_allreduce_fusion",
            self.enable_flashinfer_allreduce_fusion,
            "true or false",
        )
        check(
            self.splitwise_role in SPLITWISE_ROLES,
            "splitwise_role",
            self.splitwise_role,
            ", ".join(SPLITWISE_ROLES),
        )
