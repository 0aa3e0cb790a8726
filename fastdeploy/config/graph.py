"""CUDA graph settings and their JSON form: :class:`GraphOptimizationConfig`."""

from __future__ import annotations

from dataclasses import dataclass, field

from fastdeploy.config.checks import check, check_int, config_from_value


@dataclass
class GraphOptimizationConfig:
    """CUDA graph settings; see ``docs/graph-optimization.md`` in the shared docs for semantics.

    Capture sizes: decode buckets count requests, prefill buckets count tokens. ``None`` means the
    default ladder (see :mod:`fastdeploy.model_executor.graph_optimization.capture_sizes`).

    ``capture_in_background`` (default true): the engine serves as soon as the KV cache is
    allocated and captures the buckets one at a time between steps, the buckets traffic needs
    first first; a step whose bucket is not captured yet runs eagerly. False captures every
    bucket before the engine takes a request (the behaviour before issue #47). The policy turns
    it off where a bucket's capture is too slow to fit between steps (``graph_opt_level`` > 0
    compiles each bucket for tens of seconds) and says so (``GraphPlan.reasons``).
    """

    use_cudagraph: bool = True
    graph_opt_level: int = 0
    full_cuda_graph: bool = False
    cudagraph_capture_sizes: list[int] | None = None
    cudagraph_capture_sizes_prefill: list[int] | None = None
    max_capture_shape_prefill: int = 8192
    cudagraph_num_of_warmups: int = 2
    use_unique_memory_pool: bool = True
    cudagraph_only_prefill: bool = False
    cudagraph_splitting_ops: list[str] = field(default_factory=lambda: ["attention"])
    capture_in_background: bool = True

    def __post_init__(self) -> None:
        for name in (
            "use_cudagraph",
            "full_cuda_graph",
            "cudagraph_only_prefill",
            "capture_in_background",
        ):
            value = getattr(self, name)
            check(isinstance(value, bool), name, value, "true or false")
        check(
            self.use_unique_memory_pool is True,
            "use_unique_memory_pool",
            self.use_unique_memory_pool,
            "true: every graph of the engine shares one memory pool by design (captured largest "
            "first, so smaller graphs reuse the larger ones' blocks); separate pools would only "
            "multiply graph memory",
        )
        check(
            self.graph_opt_level in (0, 1, 2) and not isinstance(self.graph_opt_level, bool),
            "graph_opt_level",
            self.graph_opt_level,
            "0, 1 or 2",
        )
        check_int("max_capture_shape_prefill", self.max_capture_shape_prefill)
        check_int("cudagraph_num_of_warmups", self.cudagraph_num_of_warmups, minimum=0)
        for name in ("cudagraph_capture_sizes", "cudagraph_capture_sizes_prefill"):
            sizes = getattr(self, name)
            if sizes is None:
                continue
            check(
                isinstance(sizes, list) and len(sizes) > 0,
                name,
                sizes,
                "a non-empty list of positive integers or null",
            )
            for s in sizes:
                check(
                    isinstance(s, int) and not isinstance(s, bool) and s > 0,
                    name,
                    sizes,
                    f"a list of positive integers (found {s!r})",
                )
        check(
            isinstance(self.cudagraph_splitting_ops, list)
            and all(isinstance(o, str) for o in self.cudagraph_splitting_ops)
            and self.cudagraph_splitting_ops == ["attention"],
            "cudagraph_splitting_ops",
            self.cudagraph_splitting_ops,
            '["attention"]',
        )

    @classmethod
    def from_value(
        cls, value: GraphOptimizationConfig | dict | str | None
    ) -> GraphOptimizationConfig:
        """Build from a dict, a JSON string, ``None`` (defaults) or an instance.

        Raises:
            ValueError: bad JSON, an unknown key (with close matches) or a bad field value.
        """
        return config_from_value(cls, value, "graph_optimization_config")
