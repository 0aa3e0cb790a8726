"""The graph policy: one function turns the whole :class:`FDConfig` into a :class:`GraphPlan`.

It runs once, in the engine; workers receive the plan (``to_dict``/``from_dict``) and do not
re-derive it. Every feature it turns off carries a reason that users can read (startup log,
``--print-config``). The rules are numbered as in ``docs/graph-optimization.md`` (shared docs):

1. the platform cannot capture CUDA graphs (CPU) -> all graphs off;
2. ``use_cudagraph=false`` -> all graphs off;
3. ``full_cuda_graph=true`` -> prefill graphs off;
4. ``splitwise_role="prefill"`` -> decode graphs off (prefill graphs on unless another rule says
   no);
5. ``splitwise_role="decode"`` -> prefill graphs off;
6. ``cudagraph_only_prefill=true`` -> decode graphs off;
7. a host KV tier (``swap_space > 0``) -> prefill graphs off, whichever path turned them on;
8. bucket lists: explicit ones as given, default ladders capped at ``max_num_seqs`` (decode) and
   ``max_num_batched_tokens`` (prefill).
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

logger = logging.getLogger(__name__)

PLATFORMS = ("cuda", "cpu")
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
    """

    decode_graphs: bool
    prefill_graphs: bool
    decode_capture_sizes: list[int]
    prefill_capture_sizes: list[int]
    full_cuda_graph: bool
    graph_opt_level: int
    reasons: list[str] = field(default_factory=list)

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
        """At least one graph is captured."""
        return self.decode_graphs or self.prefill_graphs

    def decode_bucket(self, num_reqs: int) -> int | None:
        """Decode bucket for a decode-only step of ``num_reqs`` requests; None: run eagerly."""
        return pick_bucket(self.decode_capture_sizes, num_reqs)

    def prefill_bucket(self, num_tokens: int) -> int | None:
        """Piecewise bucket for a prefill/mixed step of ``num_tokens`` tokens; None: run eagerly."""
        return pick_bucket(self.prefill_capture_sizes, num_tokens)

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


def _switch_reasons(config: FDConfig, platform: str) -> tuple[bool, bool, list[str]]:
    """Rules 1-7: whether decode and prefill graphs are on, and why each one that is off is."""
    graph = config.graph_opt_config
    role = config.parallel_config.splitwise_role
    swap_space = config.cache_config.swap_space
    if platform != "cuda":
        return False, False, [f"all graphs off: platform {platform!r} cannot capture CUDA graphs"]
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
    if config.device_config.attention_backend == "torch_native" and decode:
        decode = False
        reasons.append(
            "decode graphs off: the torch_native attention backend loops over requests on the "
            "host and cannot run inside a full CUDA graph (use the flashinfer backend)"
        )
    # Rule 7 comes after every rule that can leave prefill graphs on (default, 4, 6).
    if swap_space > 0 and prefill:
        prefill = False
        reasons.append(
            f"prefill graphs off: a host KV tier is configured (swap_space={swap_space:g} GiB); "
            "host blocks are swapped in layer by layer inside the forward, which a captured "
            "graph cannot wait for"
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


def resolve_graph_plan(config: FDConfig, platform: str) -> GraphPlan:
    """Resolve which CUDA graphs to capture, and their buckets, for ``config`` on ``platform``.

    ``platform`` is passed in (``"cuda"`` or ``"cpu"``) so that a CUDA plan can be resolved and
    printed on a machine without a GPU. Also checks the removed block-wise environment variables.

    Args:
        config: a resolved engine config (``max_num_batched_tokens`` set, as
            ``EngineArgs.create_engine_config`` leaves it).
        platform: ``"cuda"`` or ``"cpu"``.

    Raises:
        ValueError: an unknown platform, an unresolved or inconsistent config (see
            :meth:`FDConfig.validate`), or a block-wise variable set (see
            :func:`check_block_wise_env`).
    """
    check(platform in PLATFORMS, "platform", platform, ", ".join(PLATFORMS))
    check_block_wise_env()
    config.validate()  # the config may have been edited since it was built
    graph, sched = config.graph_opt_config, config.scheduler_config
    decode, prefill, reasons = _switch_reasons(config, platform)

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
    return GraphPlan(
        decode_graphs=decode,
        prefill_graphs=prefill,
        decode_capture_sizes=decode_sizes,
        prefill_capture_sizes=prefill_sizes,
        full_cuda_graph=graph.full_cuda_graph,
        graph_opt_level=graph.graph_opt_level,
        reasons=reasons,
    )
