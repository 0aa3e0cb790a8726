"""The whole engine configuration, :class:`FDConfig`: its parts, the checks across them, what
the engine cannot run yet, and the round trip through a plain dict.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from fastdeploy.config.cache import CacheConfig
from fastdeploy.config.checks import check, unknown_key_error
from fastdeploy.config.device import DeviceConfig
from fastdeploy.config.graph import GraphOptimizationConfig
from fastdeploy.config.kv_events import KVEventsConfig
from fastdeploy.config.model import LoadConfig, ModelConfig
from fastdeploy.config.parallel import ParallelConfig
from fastdeploy.config.scheduler import SchedulerConfig
from fastdeploy.config.splitwise import SplitwiseConfig


@dataclass
class FDConfig:
    """The whole engine configuration, built by :class:`fastdeploy.engine.args_utils.EngineArgs`.

    ``model_source`` is where ``model_config.model`` resolved to (directory, weights format and the
    Hugging Face config); ``EngineArgs.create_engine_config`` sets it, together with the device and
    the attention backend, so the graph policy and the engine read one resolved config. It is not
    part of :meth:`to_dict` (it is derived from ``model_config`` and ``load_config``).
    """

    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    splitwise_config: SplitwiseConfig = field(default_factory=SplitwiseConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    load_config: LoadConfig = field(default_factory=LoadConfig)
    device_config: DeviceConfig = field(default_factory=DeviceConfig)
    graph_opt_config: GraphOptimizationConfig = field(default_factory=GraphOptimizationConfig)
    kv_events_config: KVEventsConfig = field(default_factory=KVEventsConfig)
    # A ModelSource (fastdeploy.model_executor.model_loader.source); typed Any so that this low
    # module imports nothing above it.
    model_source: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def parts(cls) -> list[dataclasses.Field]:
        """The config parts (every field but ``model_source``)."""
        return [f for f in dataclasses.fields(cls) if f.name != "model_source"]

    def not_supported_yet(self) -> list[str]:
        """One sentence per setting the engine cannot run yet (empty when it can run them all).

        The plan of such a deployment can still be resolved and printed (``--print-config``);
        :meth:`check_supported` refuses it at engine start.
        """
        problems = []
        role = self.parallel_config.splitwise_role
        if role != "mixed" and self.parallel_config.tensor_parallel_size > 1:
            problems.append(
                f"splitwise_role={role!r} with tensor_parallel_size="
                f"{self.parallel_config.tensor_parallel_size} is not supported yet; allowed: "
                "tensor_parallel_size=1 on prefill and decode nodes"
            )
        swap = self.cache_config.swap_space
        tp = self.parallel_config.tensor_parallel_size
        if swap > 0 and tp > 1:
            problems.append(
                f"swap_space={swap!r} with tensor_parallel_size={tp} is not supported yet; "
                "allowed: swap_space=0 with tensor parallelism (the host tier runs on one rank)"
            )
        if swap > 0 and role == "decode":
            problems.append(
                f"swap_space={swap!r} with splitwise_role='decode' is not supported yet; allowed: "
                "swap_space=0 on decode nodes (their prompts' KV comes from the prefill node)"
            )
        return problems

    def check_supported(self) -> None:
        """Refuse what the engine cannot run yet.

        Raises:
            ValueError: listing every unsupported setting (see :meth:`not_supported_yet`).
        """
        problems = self.not_supported_yet()
        if problems:
            raise ValueError("; ".join(problems))

    def validate(self) -> None:
        """Cross-field checks; each part has already checked its own fields.

        Limits involving ``max_num_batched_tokens`` or ``max_model_len`` are checked once those are
        resolved (not None). Explicit capture sizes are never truncated: one above its limit is an
        error, because a graph larger than any step only costs memory and start-up time.

        Raises:
            ValueError: naming the field, the value and the limit it breaks.
        """
        for f in self.parts():
            part = getattr(self, f.name)
            check(isinstance(part, f.default_factory), f.name, part, f.default_factory.__name__)
        sched, graph = self.scheduler_config, self.graph_opt_config
        budget, max_model_len = sched.max_num_batched_tokens, self.model_config.max_model_len
        decode_sizes = graph.cudagraph_capture_sizes
        if decode_sizes is not None:
            check(
                max(decode_sizes) <= sched.max_num_seqs,
                "graph_optimization_config.cudagraph_capture_sizes",
                decode_sizes,
                f"sizes <= max_num_seqs={sched.max_num_seqs} (decode buckets count requests; "
                f"found {max(decode_sizes)})",
            )
        if budget is None:
            return
        prefill_sizes = graph.cudagraph_capture_sizes_prefill
        if prefill_sizes is not None:
            check(
                max(prefill_sizes) <= budget,
                "graph_optimization_config.cudagraph_capture_sizes_prefill",
                prefill_sizes,
                f"sizes <= max_num_batched_tokens={budget} (prefill buckets count tokens; "
                f"found {max(prefill_sizes)})",
            )
        check(
            sched.max_num_seqs <= budget,
            "max_num_seqs",
            sched.max_num_seqs,
            f"<= max_num_batched_tokens={budget} (every running request needs a token of the "
            "step budget)",
        )
        if not sched.enable_chunked_prefill and max_model_len is not None:
            check(
                budget >= max_model_len,
                "max_num_batched_tokens",
                budget,
                f">= max_model_len={max_model_len} when enable_chunked_prefill is false (a whole "
                "prompt must fit one step)",
            )

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Plain JSON-able dict, one key per part (round-trips through :meth:`from_dict`)."""
        return {f.name: dataclasses.asdict(getattr(self, f.name)) for f in self.parts()}

    @classmethod
    def from_dict(cls, data: dict[str, dict[str, Any]]) -> FDConfig:
        """Inverse of :meth:`to_dict`; unknown parts or keys raise ``ValueError``."""
        parts = {f.name: f for f in cls.parts()}
        kwargs = {}
        for name, values in data.items():
            if name not in parts:
                raise unknown_key_error("config part", name, list(parts))
            check(isinstance(values, dict), name, values, "a JSON object of that part's fields")
            part_cls = parts[name].default_factory  # the part's class
            valid = [f.name for f in dataclasses.fields(part_cls)]
            for key in values:
                if key not in valid:
                    raise unknown_key_error(f"{name} key", key, valid)
            kwargs[name] = part_cls(**values)
        return cls(**kwargs)
