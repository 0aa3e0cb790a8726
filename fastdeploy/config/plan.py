"""The resolved plan of one deployment: :class:`DeploymentPlan`, which holds the CUDA graph plan
(:class:`GraphPlan`) and the deployment rules that are not graphs (the overlap schedule, the fused
all-reduce).

These are plain data, validated in ``__post_init__``, that round-trip through a JSON-able dict:
the plan is resolved once per start (:func:`fastdeploy.config.resolve.resolve_deployment`),
printed by ``--print-config``, sent to the engine process and the tensor-parallel ranks, and
reported by the running engine (``/v1/server_info``), never re-derived or edited on the way.

Who decides what (one owner per rule, each with its reason line):

* the graph rules 1-8 (which graphs, which buckets):
  :func:`fastdeploy.model_executor.graph_optimization.policy.resolve_graph_plan`;
* rule 9, the fused all-reduce + residual add + RMSNorm:
  :func:`fastdeploy.config.resolve.allreduce_fusion_rule`;
* rule 10, the overlap schedule: :func:`fastdeploy.config.resolve.overlap_schedule_rule`.

``graph_opt_level`` and ``full_cuda_graph`` are not copied here: they live in
``FDConfig.graph_opt_config`` alone, where the policy and the capture read them.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from fastdeploy.config.checks import check, unknown_key_error


def normalize_sizes(sizes: Sequence[int]) -> list[int]:
    """Explicit sizes deduplicated and sorted largest first (nothing is dropped)."""
    return sorted(set(sizes), reverse=True)


def pick_bucket(sizes_desc: Sequence[int], n: int) -> int | None:
    """The smallest bucket ``>= n`` of ``sizes_desc`` (sorted largest first), or None.

    None means ``n`` exceeds the largest bucket (or there are no buckets): the step runs eagerly.
    Binary search, so it is cheap enough to call on every step.

    Raises:
        ValueError: ``n < 1``.
    """
    if n < 1:
        raise ValueError(f"n={n!r} is invalid; allowed: an integer >= 1 (requests or tokens)")
    # sizes_desc negated is ascending; the insertion point after -n is the first bucket below n.
    i = bisect.bisect_right(sizes_desc, -n, key=lambda s: -s)
    return sizes_desc[i - 1] if i > 0 else None


def _check_keys(kind: str, cls: type, data: dict[str, Any]) -> None:
    names = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in names:
            raise unknown_key_error(kind, key, names)


@dataclass
class GraphPlan:
    """The resolved CUDA graph plan of one deployment (rules 1-8 of the graph policy).

    Attributes:
        decode_graphs: decode-only steps replay one full graph per decode bucket.
        prefill_graphs: prefill and mixed steps replay piecewise graphs per token bucket.
        decode_capture_sizes: decode buckets (requests), largest first; empty when decode graphs
            are off.
        prefill_capture_sizes: prefill/mixed buckets (tokens), largest first; empty when prefill
            graphs are off.
        reasons: one readable sentence per graph the policy turned off (or kept on against a
            setting that could have turned it off), and one on when the graphs are captured.
        capture_in_background: the engine serves before the graphs are captured and captures
            them one bucket at a time between steps (false: all of them before serving, or
            no graphs).
    """

    decode_graphs: bool
    prefill_graphs: bool
    decode_capture_sizes: list[int]
    prefill_capture_sizes: list[int]
    reasons: list[str] = field(default_factory=list)
    capture_in_background: bool = False

    def __post_init__(self) -> None:
        check(
            isinstance(self.capture_in_background, bool)
            and (self.any_graphs or not self.capture_in_background),
            "capture_in_background",
            self.capture_in_background,
            "true or false (false when no graph is captured)",
        )
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
        """Plain JSON-able dict (round-trips through :meth:`from_dict`)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GraphPlan:
        """Inverse of :meth:`to_dict`.

        Raises:
            ValueError: an unknown key (with close matches) or an inconsistent plan.
        """
        _check_keys("graph plan key", cls, data)
        return cls(**data)

    def describe(self) -> str:
        """Multi-line summary of the graphs (part of :meth:`DeploymentPlan.describe`)."""

        def sizes(on: bool, values: list[int]) -> str:
            if not on:
                return "off"
            return f"on, {len(values)} buckets {values[0]}..{values[-1]}"

        lines = [
            f"decode graphs (full): {sizes(self.decode_graphs, self.decode_capture_sizes)}",
            "prefill/mixed graphs (piecewise): "
            f"{sizes(self.prefill_graphs, self.prefill_capture_sizes)}",
        ]
        if self.any_graphs:
            when = (
                "in the background while serving"
                if self.capture_in_background
                else "before serving"
            )
            lines.append(f"capture: {when}")
        lines += [f"  - {r}" for r in self.reasons]
        return "\n".join(lines)


@dataclass(frozen=True)
class DeploymentPlan:
    """The resolved plan of one deployment: the graph plan plus the step-loop and communication
    rules. Built by :func:`fastdeploy.config.resolve.plan_deployment`; frozen, so what
    ``--print-config`` shows is what runs.

    Attributes:
        graph: the CUDA graph plan (rules 1-8).
        overlap_schedule: rule 10, the engine schedules step N+1 while step N runs and learns
            step N's tokens one step later.
        allreduce_fusion: rule 9, row-parallel outputs take flashinfer's fused all-reduce +
            residual add + RMSNorm.
        allreduce_fusion_max_tokens: the tokens its workspace holds (0 when off): the largest
            step the engine can run, so no step falls back to the unfused path.
        reasons: one readable sentence per rule 9 and 10 decision worth reporting (why a rule is
            off, or what it costs); the graph rules' reasons are in ``graph.reasons``.
    """

    graph: GraphPlan
    overlap_schedule: bool = False
    allreduce_fusion: bool = False
    allreduce_fusion_max_tokens: int = 0
    reasons: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check(isinstance(self.graph, GraphPlan), "graph", self.graph, "a GraphPlan")
        for name in ("overlap_schedule", "allreduce_fusion"):
            value = getattr(self, name)
            check(isinstance(value, bool), name, value, "true or false")
        tokens = self.allreduce_fusion_max_tokens
        check(
            isinstance(tokens, int)
            and not isinstance(tokens, bool)
            and (tokens > 0 if self.allreduce_fusion else tokens == 0),
            "allreduce_fusion_max_tokens",
            tokens,
            "a positive integer when allreduce_fusion is on, 0 when off",
        )
        # A list from JSON (from_dict) becomes the tuple a frozen plan keeps.
        object.__setattr__(self, "reasons", tuple(self.reasons))

    @property
    def all_reasons(self) -> list[str]:
        """Every reason line: the graph rules', then rules 9 and 10's."""
        return [*self.graph.reasons, *self.reasons]

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict, ``graph`` nested (round-trips through :meth:`from_dict`):
        what ``--print-config`` prints and the running engine reports."""
        return {
            "graph": self.graph.to_dict(),
            "overlap_schedule": self.overlap_schedule,
            "allreduce_fusion": self.allreduce_fusion,
            "allreduce_fusion_max_tokens": self.allreduce_fusion_max_tokens,
            "reasons": list(self.reasons),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DeploymentPlan:
        """Inverse of :meth:`to_dict`.

        Raises:
            ValueError: an unknown key (with close matches), a missing ``graph`` or an
                inconsistent plan.
        """
        _check_keys("deployment plan key", cls, data)
        check("graph" in data, "graph", None, "the graph plan as a JSON object")
        return cls(**{**data, "graph": GraphPlan.from_dict(data["graph"])})

    def describe(self) -> str:
        """Multi-line summary for the startup log."""
        fusion = (
            f"on, workspace for {self.allreduce_fusion_max_tokens} tokens"
            if self.allreduce_fusion
            else "off"
        )
        lines = [
            self.graph.describe(),
            f"overlap schedule: {'on' if self.overlap_schedule else 'off'}",
            f"allreduce fusion: {fusion}",
        ]
        lines += [f"  - {r}" for r in self.reasons]
        return "\n".join(lines)
