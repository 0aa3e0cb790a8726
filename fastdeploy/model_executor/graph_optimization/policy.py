"""The graph policy: one function turns the whole :class:`FDConfig` into a :class:`GraphPlan`,
and one pure function (:meth:`GraphPlan.dispatch`) picks each step's graph mode and bucket.

The policy runs once, on a resolved config (device and attention backend decided); workers receive
the plan (``to_dict``/``from_dict``), never re-derive it and never edit it, so ``--print-config``
shows what will run. It asks the :class:`~fastdeploy.platforms.Platform` and the attention backend
class what they support rather than comparing names. Every feature it turns off carries a reason
that users can read (startup log, ``--print-config``). The rules are numbered as in
``docs/graph-optimization.md`` (shared docs):

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
   ``max_num_batched_tokens`` (prefill).
9. tensor parallelism: the fused all-reduce + residual add + RMSNorm is on only with
   ``enable_flashinfer_allreduce_fusion``, on CUDA, on one host and where flashinfer's comm module
   imports; its workspace holds the largest step (:func:`_allreduce_fusion`).
10. the overlap schedule (the host prepares step N+1 while the device runs step N) is on unless
   ``disable_overlap_schedule``, tensor parallelism, a PD role or a host KV tier turns it off
   (:func:`_overlap_schedule`); not a graph, but a step-loop switch that this plan carries so
   that ``--print-config`` shows it with its reason.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

from fastdeploy import envs
from fastdeploy.config import FDConfig, check, unknown_key_error
from fastdeploy.model_executor.graph_optimization.capture_sizes import (
    default_decode_sizes,
    default_prefill_sizes,
    normalize_sizes,
    pick_bucket,
)
from fastdeploy.model_executor.layers.attention.selector import get_attention_backend_cls
from fastdeploy.platforms import get_platform

logger = logging.getLogger(__name__)

#: The graph modes of a step, as :meth:`GraphPlan.dispatch` returns them and ``/metrics`` counts.
GRAPH_MODES = ("full", "piecewise", "eager")
_BLOCK_WISE_VARS = ("FD_USE_BLOCK_WISE_CUDA_GRAPH", "FD_BLOCK_WISE_CUDA_GRAPH_SIZES")


@dataclass
class GraphPlan:
    """The resolved CUDA graph plan of one deployment.

    Attributes:
        decode_graphs: decode-only steps replay one full graph per decode bucket.
        prefill_graphs: prefill and mixed steps replay piecewise graphs per token bucket.
        decode_capture_sizes: decode buckets (requests), largest first; empty when decode graphs
            are off.
        prefill_capture_sizes: prefill/mixed buckets (tokens), largest first; empty when prefill
            graphs are off.
        full_cuda_graph: the configured ``full_cuda_graph`` (prefill/mixed steps run eagerly).
        graph_opt_level: 0 eager segments, 1 ``torch.compile``d segments, 2 with max-autotune.
        reasons: one readable sentence per feature the policy turned off.
        allreduce_fusion: rule 9, the fused all-reduce + residual add + RMSNorm is on (a reason
            line says why it is on or off under tensor parallelism).
        allreduce_fusion_max_tokens: the tokens its workspace holds (0 when off): the largest
            step the engine can run, so no step falls back to the unfused path.
        overlap_schedule: rule 10, the engine schedules step N+1 while step N runs and learns
            step N's tokens one step later (a reason line says why when it is off).
    """

    decode_graphs: bool
    prefill_graphs: bool
    decode_capture_sizes: list[int]
    prefill_capture_sizes: list[int]
    full_cuda_graph: bool
    graph_opt_level: int
    reasons: list[str] = field(default_factory=list)
    allreduce_fusion: bool = False
    allreduce_fusion_max_tokens: int = 0
    overlap_schedule: bool = False

    def __post_init__(self) -> None:
        for on, name in (
            (self.decode_graphs, "decode_capture_sizes"),
            (self.prefill_graphs, "prefill_capture_sizes"),
        ):
            sizes = getattr(self, name)
            check(
                isinstance(sizes, list) and (len(sizes) > 0) == on,
                name,
                sizes,
                "a non-empty list when its graphs are on, [] when off",
            )
            check(
                sizes == normalize_sizes(sizes) and all(s > 0 for s in sizes),
                name,
                sizes,
                "distinct positive integers, largest first",
            )

    @property
    def any_graphs(self) -> bool:
        """At least one graph is captured (the worker warms up and captures only then)."""
        return self.decode_graphs or self.prefill_graphs

    def dispatch(
        self, is_decode_only: bool, num_reqs: int, num_tokens: int
    ) -> tuple[str, int | None]:
        """The graph mode and bucket of one step, from host-side scheduler data only (pure).

        * decode-only, decode graphs on: the full graph of the smallest decode bucket
          ``>= num_reqs``; above the largest decode bucket the step runs eagerly (a decode step
          never takes a piecewise bucket while decode graphs are on);
        * otherwise, prefill graphs on: the piecewise graphs of the smallest prefill bucket
          ``>= num_tokens``; above the largest prefill bucket, eager;
        * otherwise eager.

        Args:
            is_decode_only: every request of the step adds exactly one token.
            num_reqs: requests in the step.
            num_tokens: tokens in the step (before padding).

        Returns:
            ``("full", bucket)``, ``("piecewise", bucket)`` or ``("eager", None)``; the bucket
            is the padded size (requests for ``full``, tokens for ``piecewise``).
        """
        if is_decode_only and self.decode_graphs:
            bucket = pick_bucket(self.decode_capture_sizes, num_reqs)
            return ("full", bucket) if bucket is not None else ("eager", None)
        if self.prefill_graphs:
            bucket = pick_bucket(self.prefill_capture_sizes, num_tokens)
            if bucket is not None:
                return "piecewise", bucket
        return "eager", None

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (sent to workers; round-trips through :meth:`from_dict`)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GraphPlan:
        """Inverse of :meth:`to_dict`.

        Raises:
            ValueError: an unknown key (with close matches) or an inconsistent plan.
        """
        names = [f.name for f in dataclasses.fields(cls)]
        for key in data:
            if key not in names:
                raise unknown_key_error("graph plan key", key, names)
        return cls(**data)

    def describe(self) -> str:
        """Multi-line summary for the startup log and ``--print-config``."""

        def sizes(on: bool, values: list[int]) -> str:
            if not on:
                return "off"
            return f"on, {len(values)} buckets {values[0]}..{values[-1]}"

        decode = sizes(self.decode_graphs, self.decode_capture_sizes)
        prefill = sizes(self.prefill_graphs, self.prefill_capture_sizes)
        lines = [
            f"decode graphs (full): {decode}",
            f"prefill/mixed graphs (piecewise): {prefill}",
            f"full_cuda_graph={self.full_cuda_graph}, graph_opt_level={self.graph_opt_level}",
            f"overlap schedule: {'on' if self.overlap_schedule else 'off'}",
        ]
        lines += [f"  - {r}" for r in self.reasons]
        return "\n".join(lines)


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


def _allreduce_fusion(config: FDConfig, prefill_sizes: list[int]) -> tuple[bool, int, str | None]:
    """Rule 9: ``(on, workspace tokens, reason line)`` of the fused all-reduce + residual add +
    RMSNorm. No reason line with one rank unless the flag asks for it (nothing to report)."""
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


def _overlap_schedule(config: FDConfig) -> tuple[bool, str | None]:
    """Rule 10: ``(on, reason line)`` of the overlap schedule; the reason says why it is off, or
    what it costs where it gains nothing (a synchronous device)."""
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
    fusion, fusion_tokens, fusion_reason = _allreduce_fusion(config, prefill_sizes)  # rule 9
    overlap, overlap_reason = _overlap_schedule(config)  # rule 10
    extra = [r for r in (fusion_reason, overlap_reason) if r is not None]
    return GraphPlan(
        decode_graphs=decode,
        prefill_graphs=prefill,
        decode_capture_sizes=decode_sizes,
        prefill_capture_sizes=prefill_sizes,
        full_cuda_graph=graph.full_cuda_graph,
        graph_opt_level=graph.graph_opt_level,
        reasons=reasons + extra,
        allreduce_fusion=fusion,
        allreduce_fusion_max_tokens=fusion_tokens,
        overlap_schedule=overlap,
    )
