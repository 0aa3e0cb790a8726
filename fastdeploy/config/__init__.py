"""Validated configuration of the engine.

Every part is a dataclass checked once in ``__post_init__``: a bad value raises ``ValueError``
naming the field, the value and what is allowed; :meth:`FDConfig.validate` checks the limits across
parts. Values discovered at start-up (KV block counts, eos ids) are runtime state and live in
runtime objects, never here. Field names follow FastDeploy's public ones.

One module per concern: ``checks`` (the ``check`` helper and validators), ``model`` (model and
weight loading), ``cache``, ``kv_events`` (KV-cache event publishing), ``parallel``,
``splitwise``, ``scheduler``, ``device``, ``graph`` (CUDA graphs), ``fd_config``
(:class:`FDConfig`, the whole) and ``plan`` (:class:`DeploymentPlan` and its :class:`GraphPlan`,
resolved from a config). Import the names from here.
``fastdeploy.config.resolve`` (``resolve_deployment``) is imported by its full name: it reaches the
layers above (see its docstring).
"""

from __future__ import annotations

from fastdeploy.config.cache import (
    HOST_STORE_POLICIES,
    PREFIX_CACHING_HASH_ALGOS,
    SWAP_IN_MODES,
    CacheConfig,
)
from fastdeploy.config.checks import check, check_int, is_number, unknown_key_error
from fastdeploy.config.device import DEVICES, DeviceConfig
from fastdeploy.config.fd_config import FDConfig
from fastdeploy.config.graph import GraphOptimizationConfig
from fastdeploy.config.kv_events import KV_EVENT_PUBLISHERS, KVEventsConfig
from fastdeploy.config.model import DTYPES, LOAD_FORMATS, LoadConfig, ModelConfig
from fastdeploy.config.parallel import SPLITWISE_ROLES, ParallelConfig
from fastdeploy.config.plan import DeploymentPlan, GraphPlan
from fastdeploy.config.scheduler import SchedulerConfig
from fastdeploy.config.splitwise import (
    CACHE_TRANSFER_PROTOCOLS,
    KV_LOAD_FAILURE_POLICIES,
    SplitwiseConfig,
)

__all__ = [
    "CACHE_TRANSFER_PROTOCOLS",
    "DEVICES",
    "DTYPES",
    "HOST_STORE_POLICIES",
    "KV_EVENT_PUBLISHERS",
    "KV_LOAD_FAILURE_POLICIES",
    "LOAD_FORMATS",
    "PREFIX_CACHING_HASH_ALGOS",
    "SPLITWISE_ROLES",
    "SWAP_IN_MODES",
    "CacheConfig",
    "DeploymentPlan",
    "DeviceConfig",
    "FDConfig",
    "GraphOptimizationConfig",
    "GraphPlan",
    "KVEventsConfig",
    "LoadConfig",
    "ModelConfig",
    "ParallelConfig",
    "SchedulerConfig",
    "SplitwiseConfig",
    "check",
    "check_int",
    "is_number",
    "unknown_key_error",
]
