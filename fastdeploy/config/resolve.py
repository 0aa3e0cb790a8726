"""Resolve one deployment, once per start: :func:`resolve_deployment` turns the engine arguments
into the validated :class:`~fastdeploy.config.FDConfig` and its
:class:`~fastdeploy.config.plan.DeploymentPlan`.

Called by the server's start-up (:mod:`fastdeploy.entrypoints.launch`: ``fastdeploy serve``,
``--print-config``), by :meth:`fastdeploy.engine.engine.LLMEngine.from_engine_args` (the offline
``LLM``) and by tests; the engine requires a plan and never resolves one itself.

This module also owns the two deployment rules that are not graphs, each with its reason line:
rule 9 (:func:`allreduce_fusion_rule`) and rule 10 (:func:`overlap_schedule_rule`). The graph
rules 1-8 belong to :func:`fastdeploy.model_executor.graph_optimization.policy.resolve_graph_plan`.

Unlike the rest of :mod:`fastdeploy.config`, resolving needs the layers above it (the model's
config, the attention backends, the graph policy, flashinfer's comm module): this module ranks with
the engine (``tests/test_layering.py``), and only the engine and the entry points import it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from fastdeploy.config.checks import check
from fastdeploy.config.fd_config import FDConfig
from fastdeploy.config.plan import DeploymentPlan, GraphPlan
from fastdeploy.platforms import get_platform

if TYPE_CHECKING:
    from fastdeploy.model_executor.model_loader.source import ModelSource


class EngineArgsLike(Protocol):
    """What :func:`resolve_deployment` needs of
    :class:`~fastdeploy.engine.args_utils.EngineArgs`: its one-pass resolution."""

    def create_engine_config(self, model_source: ModelSource | None = None) -> FDConfig: ...


def resolve_deployment(
    engine_args: EngineArgsLike, model_source: ModelSource | None = None
) -> tuple[FDConfig, DeploymentPlan]:
    """Resolve ``engine_args`` into the config and the plan that will run (reads the model's
    config, no weights).

    Args:
        engine_args: the start's :class:`~fastdeploy.engine.args_utils.EngineArgs` (built once
            per start).
        model_source: an already resolved model (tests); None resolves ``engine_args.model``.

    Returns:
        ``(config, plan)``: :meth:`EngineArgs.create_engine_config`'s config and
        :func:`plan_deployment`'s plan of it.

    Raises:
        ValueError: a bad argument or combination, naming the field, the value and the limit.
        FileNotFoundError: the model does not exist.
    """
    config = engine_args.create_engine_config(model_source)
    return config, plan_deployment(config)


def plan_deployment(config: FDConfig) -> DeploymentPlan:
    """The :class:`DeploymentPlan` of a resolved ``config``: the graph plan (rules 1-8), then
    rule 9 (:func:`allreduce_fusion_rule`) and rule 10 (:func:`overlap_schedule_rule`).

    The platform is ``config.device_config.device``, so a CUDA plan can be resolved and printed
    on a machine without a GPU (``--print-config --device cuda``). Does not refuse settings
    that are not supported yet (:meth:`FDConfig.check_supported` does, at engine start).

    Raises:
        ValueError: an unresolved or inconsistent config, an unknown attention backend, or a
            removed block-wise graph variable set (see ``resolve_graph_plan``).
    """
    from fastdeploy.model_executor.graph_optimization.policy import resolve_graph_plan

    graph = resolve_graph_plan(config)
    fusion, fusion_tokens, fusion_reason = allreduce_fusion_rule(config, graph)
    overlap, overlap_reason = overlap_schedule_rule(config)
    return DeploymentPlan(
        graph=graph,
        overlap_schedule=overlap,
        allreduce_fusion=fusion,
        allreduce_fusion_max_tokens=fusion_tokens,
        reasons=tuple(r for r in (fusion_reason, overlap_reason) if r is not None),
    )


def allreduce_fusion_rule(config: FDConfig, graph: GraphPlan) -> tuple[bool, int, str | None]:
    """Rule 9: ``(on, workspace tokens, reason line)`` of the fused all-reduce + residual add +
    RMSNorm (flashinfer's ``trtllm_allreduce_fusion``).

    On only with ``enable_flashinfer_allreduce_fusion``, tensor parallelism, CUDA, one host, a
    world size flashinfer fuses for, and where flashinfer's comm module imports. Its workspace
    holds the largest step: ``max(max_num_batched_tokens, largest prefill bucket)`` tokens. No
    reason line with one rank unless the flag asks for it (nothing to report).

    Raises:
        ValueError: fusion would be on but ``max_num_batched_tokens`` is unresolved.
    """
    from fastdeploy.model_executor.layers import allreduce_fusion as fusion

    parallel = config.parallel_config
    world, device = parallel.tensor_parallel_size, config.device_config.device
    if world == 1 and not parallel.enable_flashinfer_allreduce_fusion:
        return False, 0, None
    if world == 1:
        why = "tensor_parallel_size=1 has no all-reduce"
    elif not parallel.enable_flashinfer_allreduce_fusion:
        backend = get_platform(device).collective_backend
        why = (
            f"enable_flashinfer_allreduce_fusion=false; row-parallel outputs take the "
            f"{backend} all-reduce (platform {device!r}), then the residual add and RMSNorm"
        )
    elif device != "cuda":
        why = f"platform {device!r}: flashinfer's fused all-reduce needs CUDA"
    elif parallel.nnodes > 1:
        why = (
            f"nnodes={parallel.nnodes}: its workspace is shared through CUDA IPC, which needs "
            "every rank on one host"
        )
    elif world not in fusion.FUSION_WORLD_SIZES:
        sizes = ", ".join(map(str, fusion.FUSION_WORLD_SIZES))
        why = f"tensor_parallel_size={world}; flashinfer fuses for {sizes} ranks"
    else:
        why = fusion.fusion_unavailable()
    if why is not None:
        return False, 0, f"allreduce fusion off: {why}"
    budget = config.scheduler_config.max_num_batched_tokens
    check(
        budget is not None,
        "max_num_batched_tokens",
        budget,
        "a resolved integer (build the config with EngineArgs.create_engine_config)",
    )
    prefill_sizes = graph.prefill_capture_sizes
    max_tokens = max([budget, *prefill_sizes])
    hf = getattr(config.model_source, "hf_config", None)
    size = ""
    if hf is not None:
        mib = fusion.workspace_bytes(world, max_tokens, hf.hidden_size) / 2**20
        size = f", about {mib:.0f} MiB per rank"
    reason = (
        "allreduce fusion on: flashinfer trtllm_allreduce_fusion (all-reduce + residual add + "
        f"RMSNorm in one kernel), workspace for {max_tokens} tokens (the largest step: "
        f"max_num_batched_tokens={budget}, largest prefill bucket "
        f"{max(prefill_sizes, default=0)}){size}"
    )
    return True, max_tokens, reason


def overlap_schedule_rule(config: FDConfig) -> tuple[bool, str | None]:
    """Rule 10: ``(on, reason line)`` of the overlap schedule (the host prepares step N+1 while
    the device runs step N).

    On unless ``disable_overlap_schedule``, tensor parallelism, a PD role or a host KV tier
    turns it off; the reason says why it is off, or what it costs where it gains nothing (a
    device that runs each step before the host goes on). None when on with nothing to say.
    """
    parallel = config.parallel_config
    why = None
    if config.scheduler_config.disable_overlap_schedule:
        why = "disable_overlap_schedule=true"
    elif parallel.tensor_parallel_size > 1:
        why = (
            f"tensor_parallel_size={parallel.tensor_parallel_size}; rank 0 sends each step to "
            "the other ranks with its token ids known on the host, so every step waits for the "
            "previous one's tokens"
        )
    elif parallel.splitwise_role != "mixed":
        why = (
            f"splitwise_role={parallel.splitwise_role}; the PD bookkeeping (first tokens, held "
            "blocks, KV pulls) runs on each step's tokens as soon as it ends"
        )
    elif config.cache_config.swap_space > 0:
        why = (
            "the host KV tier (swap_space > 0) stores and swaps blocks in between steps, timed "
            "by the step that wrote them"
        )
    if why is not None:
        return False, f"overlap schedule off: {why}"
    if not get_platform(config.device_config.device).can_capture_graphs:
        return True, (
            f"overlap schedule on: the {config.device_config.device} device runs each step "
            "before the host goes on, so nothing overlaps and outputs come one step later; it "
            "stays on so this path is tested (--disable-overlap-schedule turns it off)"
        )
    return True, None
