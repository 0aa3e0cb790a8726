"""The graph policy: one function turns the whole :class:`FDConfig` into a :class:`GraphPlan`
(the data class lives in :mod:`fastdeploy.config.plan`, with its pure per-step
:meth:`GraphPlan.dispatch`; it is importable from here too).

The policy runs once per start, on a resolved config (device and attention backend decided), as
part of :func:`fastdeploy.config.resolve.resolve_deployment`; workers receive the plan, never
re-derive it and never edit it, so ``--print-config`` shows what will run. It asks the
:class:`~fastdeploy.platforms.Platform` and the attention backend class what they support rather
than comparing names. Every graph it turns off carries a reason that users can read (startup log,
``--print-config``). The rules are numbered as in ``docs/graph-optimization.md`` (shared docs):

1. the platform cannot capture CUDA graphs (CPU) -> all graphs off; an attention backend that
   cannot run inside a full graph -> decode graphs off;
2. ``use_cudagraph=false`` -> all graphs off;
3. ``full_cuda_graph=true`` -> prefill graphs off;
4. ``splitwise_role="prefill"`` -> decode graphs off (prefill graphs on unless another rule says
   no);
5. ``splitwise_role="decode"`` -> prefill graphs off;
6. ``cudagraph_only_prefill=true`` -> decode graphs off;
7. a host KV tier that swaps in layer by layer (``swap_space > 0`` with
   ``swap_in_mode="layerwise"``) -> prefill graphs off, whichever path turned them on; with
   ``swap_in_mode="request"`` they stay on and the plan says why;
8. bucket lists: explicit ones as given, default ladders capped at ``max_num_seqs`` (decode) and
   ``max_num_batched_tokens`` (prefill);
8b. when the graphs are captured: in the background while serving
   (``capture_in_background=true``, the default), unless ``graph_opt_level > 0``, whose
   ``torch.compile`` of one bucket takes tens of seconds that a step would wait, or on a PD
   node (``splitwise_role`` prefill or decode), whose KV transfer threads make CUDA calls that a
   capture would refuse; then, or with
   ``capture_in_background=false``, before serving (see
   :mod:`fastdeploy.model_executor.graph_optimization.capture_order`).

Rules 9 (the fused all-reduce) and 10 (the overlap schedule) are not graphs: they are deployment
rules of :class:`~fastdeploy.config.plan.DeploymentPlan`, owned by
:mod:`fastdeploy.config.resolve`.
"""

from __future__ import annotations

import logging

from fastdeploy import envs
from fastdeploy.config import FDConfig, check
from fastdeploy.config.plan import GraphPlan
from fastdeploy.model_executor.graph_optimization.capture_sizes import (
    default_decode_sizes,
    default_prefill_sizes,
    normalize_sizes,
)
from fastdeploy.model_executor.layers.attention.selector import get_attention_backend_cls
from fastdeploy.platforms import get_platform

logger = logging.getLogger(__name__)

#: The graph modes of a step, as :meth:`GraphPlan.dispatch` returns them and ``/metrics`` counts.
GRAPH_MODES = ("full", "piecewise", "eager")
__all__ = ["GRAPH_MODES", "GraphPlan", "check_block_wise_env", "resolve_graph_plan"]
_BLOCK_WISE_VARS = ("FD_USE_BLOCK_WISE_CUDA_GRAPH", "FD_BLOCK_WISE_CUDA_GRAPH_SIZES")


def check_block_wise_env() -> None:
    """Refuse the removed block-wise CUDA graph switches.

    ``FD_USE_BLOCK_WISE_CUDA_GRAPH`` or ``FD_BLOCK_WISE_CUDA_GRAPH_SIZES`` set to ``0`` (or another
    "off" spelling) only logs a warning; any other non-empty value raises. Unset or empty: nothing.

    Raises:
        ValueError: a block-wise variable is set to a true value (or to sizes).
    """
    for name in _BLOCK_WISE_VARS:
        raw = envs.get(name)
        if raw is None:
            continue
        if envs.is_false_value(raw):
            logger.warning(
                "%s=%r is ignored: block-wise CUDA graphs were removed; piecewise graphs replace "
                'them (graph_optimization_config {"full_cuda_graph": false}, the default). '
                "Unset the variable to silence this warning.",
                name,
                raw,
            )
            continue
        raise ValueError(
            f"{name}={raw!r} is invalid: block-wise CUDA graphs are gone, replaced by piecewise "
            "graphs; unset it and use --graph-optimization-config '{\"full_cuda_graph\": false}' "
            "(the default; prefill buckets go in cudagraph_capture_sizes_prefill)"
        )


def _switch_reasons(config: FDConfig) -> tuple[bool, bool, list[str]]:
    """Rules 1-7: whether decode and prefill graphs are on, and why each one that is off is."""
    graph = config.graph_opt_config
    role = config.parallel_config.splitwise_role
    swap_space = config.cache_config.swap_space
    swap_in_mode = config.cache_config.swap_in_mode
    platform = get_platform(config.device_config.device)
    backend = get_attention_backend_cls(config.device_config.attention_backend)
    if not platform.can_capture_graphs:
        return (
            False,
            False,
            [f"all graphs off: platform {platform.name!r} cannot capture CUDA graphs"],
        )
    if not graph.use_cudagraph:
        return False, False, ["all graphs off: use_cudagraph=false"]

    decode, prefill, reasons = True, True, []
    if graph.full_cuda_graph:
        prefill = False
        reasons.append(
            "prefill graphs off: full_cuda_graph=true runs prefill and mixed batches eagerly "
            "(set it to false for piecewise graphs)"
        )
    if role == "prefill":
        decode = False
        reasons.append("decode graphs off: splitwise_role=prefill; a prefill node runs no decode")
    if role == "decode" and prefill:
        prefill = False
        reasons.append("prefill graphs off: splitwise_role=decode; a decode node runs no prefill")
    if graph.cudagraph_only_prefill and decode:
        decode = False
        reasons.append("decode graphs off: cudagraph_only_prefill=true")
    if not backend.supports_graph_decode and decode:
        decode = False
        hint = (
            "use the flashinfer backend"
            if platform.default_attention_backend == backend.name
            else f"the platform's default is {platform.default_attention_backend}; install it "
            "or name it with --attention-backend"
        )
        reasons.append(
            f"decode graphs off: the {backend.name} attention backend cannot run inside a full "
            f"CUDA graph ({hint})"
        )
    # Rule 7 comes after every rule that can leave prefill graphs on (default, 4, 6).
    if swap_space > 0 and swap_in_mode == "layerwise" and prefill:
        prefill = False
        reasons.append(
            f"prefill graphs off: a host KV tier swaps blocks in layer by layer "
            f"(swap_space={swap_space:g} GiB, swap_in_mode=layerwise); the forward waits for each "
            "layer's host-to-device copy inside it, which a captured graph cannot do "
            "(swap_in_mode=request keeps them on)"
        )
    elif swap_space > 0 and prefill:
        reasons.append(
            f"prefill graphs stay on: swap_in_mode=request (swap_space={swap_space:g} GiB) "
            "finishes a request's host-to-device copies before its first step, so no forward "
            "waits for a copy"
        )
    if not decode and not prefill:
        if role == "prefill" and graph.full_cuda_graph:
            reasons.append(
                "nothing to capture: a prefill node (splitwise_role=prefill) with "
                "full_cuda_graph=true runs every step eagerly; set full_cuda_graph=false for "
                "piecewise prefill graphs"
            )
        else:
            reasons.append("nothing to capture: every step runs eagerly (see the reasons above)")
    return decode, prefill, reasons


def resolve_graph_plan(config: FDConfig) -> GraphPlan:
    """Resolve which CUDA graphs to capture, and their buckets, for a resolved ``config``.

    The platform is ``config.device_config.device``, so a CUDA plan can be resolved and printed
    on a machine without a GPU (``--print-config --device cuda``). Also checks the removed
    block-wise environment variables.

    Args:
        config: a config resolved by ``EngineArgs.create_engine_config`` (device, attention
            backend and ``max_num_batched_tokens`` decided).

    Raises:
        ValueError: an unresolved device or backend, an unknown backend, an unresolved or
            inconsistent config (see :meth:`FDConfig.validate`), or a block-wise variable set
            (see :func:`check_block_wise_env`).
    """
    device = config.device_config
    check(
        device.is_resolved,
        "device_config",
        f"device={device.device!r}, attention_backend={device.attention_backend!r}",
        "a resolved device (cuda or cpu) and backend name (build the config with "
        "EngineArgs.create_engine_config)",
    )
    check_block_wise_env()
    config.validate()  # the config may have been edited since it was built
    graph, sched = config.graph_opt_config, config.scheduler_config
    decode, prefill, reasons = _switch_reasons(config)

    # Rule 8. Explicit lists were checked against their limits by validate(); nothing is dropped.
    decode_sizes: list[int] = []
    if decode:
        explicit = graph.cudagraph_capture_sizes
        decode_sizes = (
            normalize_sizes(explicit) if explicit else default_decode_sizes(sched.max_num_seqs)
        )
    prefill_sizes: list[int] = []
    if prefill:
        budget = sched.max_num_batched_tokens
        check(
            budget is not None,
            "max_num_batched_tokens",
            budget,
            "a resolved integer (build the config with EngineArgs.create_engine_config)",
        )
        explicit = graph.cudagraph_capture_sizes_prefill
        prefill_sizes = (
            normalize_sizes(explicit)
            if explicit
            else default_prefill_sizes(graph.max_capture_shape_prefill, budget)
        )
    background = False
    if decode or prefill:
        background, reason = _capture_timing(graph, config.parallel_config.splitwise_role)
        reasons.append(reason)
    return GraphPlan(
        decode_graphs=decode,
        prefill_graphs=prefill,
        decode_capture_sizes=decode_sizes,
        prefill_capture_sizes=prefill_sizes,
        reasons=reasons,
        capture_in_background=background,
    )


def _capture_timing(graph, role: str) -> tuple[bool, str]:
    """Rule 8b: whether the graphs are captured in the background while serving, and why."""
    if graph.capture_in_background and role != "mixed":
        return False, (
            f"graphs captured before serving: splitwise_role={role}; its KV transfer threads "
            "read and write the KV cache with CUDA calls of their own, which a graph capture on "
            "the engine's thread would refuse (and be invalidated by)"
        )
    if not graph.capture_in_background:
        return False, (
            "graphs captured before serving: capture_in_background=false (the engine answers "
            "requests once every bucket is captured)"
        )
    if graph.graph_opt_level > 0:
        return False, (
            f"graphs captured before serving: graph_opt_level={graph.graph_opt_level} compiles "
            "each bucket with torch.compile for tens of seconds, which a step captured between "
            "would wait (graph_opt_level=0 captures in the background)"
        )
    return True, (
        "graphs captured in the background while serving (capture_in_background=true): a step "
        "whose bucket is not captured yet runs eagerly; decode buckets <= 8 requests and "
        "prefill buckets <= 512 tokens first"
    )
