"""The paged KV cache and its host (CPU) tier: :class:`CacheConfig`."""

from __future__ import annotations

from dataclasses import dataclass

from fastdeploy.config.checks import check, check_int, is_number

SWAP_IN_MODES = ("request", "layerwise")
HOST_STORE_POLICIES = ("prompt", "all")
#: ``--prefix-caching-hash-algo`` choices implemented here, named as in vLLM v0.11.0 (which also
#: has xxhash variants; they need the ``xxhash`` package, not a dependency here).
PREFIX_CACHING_HASH_ALGOS = ("sha256", "sha256_cbor")


@dataclass
class CacheConfig:
    """Paged KV cache. ``swap_space`` is the host (CPU) KV tier in GiB; 0 means none.

    ``swap_in_mode`` says how host hits come back: ``request`` (the request waits until its
    copies land; no wait inside the forward) or ``layerwise`` (copies per layer, each layer
    waits on its own event before its KV store). ``host_store_policy`` says which full blocks
    are written through to the host: ``prompt`` blocks only, or ``all`` (decode blocks too).
    ``prefix_caching_hash_algo`` is the hash function of the prefix cache's block hash chain
    (vLLM's flag and scheme; see :mod:`fastdeploy.cache_manager.block_hash`).
    """

    block_size: int = 64
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    swap_space: float = 0
    enable_prefix_caching: bool = True
    swap_in_mode: str = "request"
    host_store_policy: str = "prompt"
    prefix_caching_hash_algo: str = "sha256"

    def __post_init__(self) -> None:
        check_int("block_size", self.block_size)
        check(
            is_number(self.gpu_memory_utilization) and 0 < self.gpu_memory_utilization <= 1,
            "gpu_memory_utilization",
            self.gpu_memory_utilization,
            "a number in (0, 1]",
        )
        check_int("num_gpu_blocks_override", self.num_gpu_blocks_override, optional=True)
        check(
            is_number(self.swap_space) and 0 <= self.swap_space < float("inf"),
            "swap_space",
            self.swap_space,
            "a number of GiB >= 0",
        )
        check(
            isinstance(self.enable_prefix_caching, bool),
            "enable_prefix_caching",
            self.enable_prefix_caching,
            "true or false",
        )
        check(
            self.swap_in_mode in SWAP_IN_MODES,
            "swap_in_mode",
            self.swap_in_mode,
            ", ".join(SWAP_IN_MODES),
        )
        check(
            self.host_store_policy in HOST_STORE_POLICIES,
            "host_store_policy",
            self.host_store_policy,
            ", ".join(HOST_STORE_POLICIES),
        )
        check(
            self.prefix_caching_hash_algo in PREFIX_CACHING_HASH_ALGOS,
            "prefix_caching_hash_algo",
            self.prefix_caching_hash_algo,
            ", ".join(PREFIX_CACHING_HASH_ALGOS),
        )
        check(
            self.swap_space == 0 or self.enable_prefix_caching,
            "swap_space",
            self.swap_space,
            "0 when enable_prefix_caching is false (the host tier holds prefix-cached blocks)",
        )
