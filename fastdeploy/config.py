"""Validated configuration of the engine.

Every part is a dataclass checked once in ``__post_init__``: a bad value raises ``ValueError``
naming the field, the value and what is allowed; :meth:`FDConfig.validate` checks the limits across
parts. Values discovered at start-up (KV block counts, eos ids) are runtime state and live in
runtime objects, never here. Field names follow FastDeploy's public ones.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from dataclasses import dataclass, field
from typing import Any

DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
SPLITWISE_ROLES = ("mixed", "prefill", "decode")
CACHE_TRANSFER_PROTOCOLS = ("auto", "nixl", "tcp")
KV_LOAD_FAILURE_POLICIES = ("fail", "recompute")
SWAP_IN_MODES = ("request", "layerwise")
HOST_STORE_POLICIES = ("prompt", "all")
DEVICES = ("auto", "cuda", "cpu")


def check(ok: bool, name: str, value: Any, allowed: str) -> None:
    """Raise ``ValueError('<name>=<value!r> is invalid; allowed: <allowed>')`` unless ``ok``."""
    if not ok:
        raise ValueError(f"{name}={value!r} is invalid; allowed: {allowed}")


def is_number(value: Any) -> bool:
    """True for an int or float that is not a bool (``True`` is not a number of GiB)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_int(name: str, value: Any, minimum: int = 1, optional: bool = False) -> None:
    """Check that ``value`` is an int (not bool) >= ``minimum`` (or None when ``optional``)."""
    if optional and value is None:
        return
    check(
        isinstance(value, int) and not isinstance(value, bool) and value >= minimum,
        name,
        value,
        f"an integer >= {minimum}" + (" or null" if optional else ""),
    )


def unknown_key_error(kind: str, key: str, valid: list[str]) -> ValueError:
    """A ``ValueError`` for an unknown key, listing the close matches (or all valid keys)."""
    close = difflib.get_close_matches(key, valid, n=3)
    hint = (
        f"did you mean {', '.join(close)}?" if close else f"valid keys: {', '.join(sorted(valid))}"
    )
    return ValueError(f"unknown {kind} {key!r}; {hint}")


@dataclass
class ModelConfig:
    """What model to run. ``model=None`` means the default SmolLM2-135M-Instruct GGUF.

    ``skip_tokenizer_init``: load no tokenizer; prompts are token ids and outputs carry no text.

    ``max_model_len`` (tokens, prompt + output) of ``None`` is resolved from the model's
    ``max_position_embeddings`` when the engine config is created.
    """

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    skip_tokenizer_init: bool = False

    def __post_init__(self) -> None:
        for name in ("model", "tokenizer"):
            value = getattr(self, name)
            check(value is None or isinstance(value, str), name, value, "a path, a name or null")
        check(self.dtype in DTYPES, "dtype", self.dtype, ", ".join(DTYPES))
        check_int("max_model_len", self.max_model_len, optional=True)
        check_int("seed", self.seed, minimum=0)
        check(
            isinstance(self.skip_tokenizer_init, bool),
            "skip_tokenizer_init",
            self.skip_tokenizer_init,
            "true or false",
        )


@dataclass
class CacheConfig:
    """Paged KV cache. ``swap_space`` is the host (CPU) KV tier in GiB; 0 means none.

    ``swap_in_mode`` says how host hits come back: ``request`` (the request waits until its
    copies land; no wait inside the forward) or ``layerwise`` (copies per layer, attention waits
    on each layer's event). ``host_store_policy`` says which full blocks are written through to
    the host: ``prompt`` blocks only, or ``all`` (decode blocks too).
    """

    block_size: int = 64
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    swap_space: float = 0
    enable_prefix_caching: bool = True
    swap_in_mode: str = "request"
    host_store_policy: str = "prompt"

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
            self.swap_space == 0 or self.enable_prefix_caching,
            "swap_space",
            self.swap_space,
            "0 when enable_prefix_caching is false (the host tier holds prefix-cached blocks)",
        )


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


@dataclass
class SplitwiseConfig:
    """Prefill/decode disaggregation (``docs/pd-disaggregation.md``, shared docs); read only
    when ``splitwise_role`` is ``prefill`` or ``decode``.

    Attributes:
        pd_comm_port: TCP port of this node's control side channel (None: a free port).
        pd_host: the address this node advertises to its peers (side channel and transport).
        cache_transfer_protocol: ``auto`` (NIXL when it imports, else tcp), ``nixl`` or ``tcp``.
        pd_lease_s: seconds a prefill node holds a finished request's blocks unclaimed (and how
            far a heartbeat extends them).
        kv_load_failure_policy: on the decode node, ``fail`` (a 5xx) or ``recompute`` (prefill
            the request locally, eagerly) when a KV transfer fails.
        pd_decode_wait_timeout: seconds a decode-leg request may wait for free blocks before it
            gets a 503.
        pd_transfer_timeout: seconds one claimed transfer may take.
    """

    pd_comm_port: int | None = None
    pd_host: str = "127.0.0.1"
    cache_transfer_protocol: str = "auto"
    pd_lease_s: float = 30.0
    kv_load_failure_policy: str = "fail"
    pd_decode_wait_timeout: float = 30.0
    pd_transfer_timeout: float = 30.0

    def __post_init__(self) -> None:
        check(
            self.pd_comm_port is None
            or (isinstance(self.pd_comm_port, int) and 0 < self.pd_comm_port < 65536),
            "pd_comm_port",
            self.pd_comm_port,
            "a TCP port in 1..65535 or null",
        )
        check(
            isinstance(self.pd_host, str) and self.pd_host != "",
            "pd_host",
            self.pd_host,
            "a host name or address",
        )
        check(
            self.cache_transfer_protocol in CACHE_TRANSFER_PROTOCOLS,
            "cache_transfer_protocol",
            self.cache_transfer_protocol,
            ", ".join(CACHE_TRANSFER_PROTOCOLS),
        )
        check(
            self.kv_load_failure_policy in KV_LOAD_FAILURE_POLICIES,
            "kv_load_failure_policy",
            self.kv_load_failure_policy,
            ", ".join(KV_LOAD_FAILURE_POLICIES),
        )
        for name in ("pd_lease_s", "pd_decode_wait_timeout", "pd_transfer_timeout"):
            value = getattr(self, name)
            check(is_number(value) and 0 < value < float("inf"), name, value, "finite seconds > 0")


@dataclass
class SchedulerConfig:
    """Continuous batching limits. ``max_num_batched_tokens`` is the per-step token budget.

    ``disable_overlap_schedule`` turns off the overlap schedule (SGLang's flag): by default the
    host schedules and prepares step N+1 while the device runs step N, where the graph policy
    finds it supported (its plan says whether it is on, and why not).

    ``None`` is resolved by ``EngineArgs.create_engine_config``: with chunked prefill to
    ``max(2048, max_num_seqs)``; without it to ``max(max_model_len, 2048, max_num_seqs)`` (a whole
    prompt must fit one step). Cross-field limits are checked by :meth:`FDConfig.validate`.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    disable_overlap_schedule: bool = False

    def __post_init__(self) -> None:
        check_int("max_num_seqs", self.max_num_seqs)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, optional=True)
        for name in ("enable_chunked_prefill", "disable_overlap_schedule"):
            value = getattr(self, name)
            check(isinstance(value, bool), name, value, "true or false")


@dataclass
class LoadConfig:
    """How weights are read: ``auto`` picks gguf for a ``.gguf`` file, else safetensors."""

    load_format: str = "auto"

    def __post_init__(self) -> None:
        check(
            self.load_format in LOAD_FORMATS,
            "load_format",
            self.load_format,
            ", ".join(LOAD_FORMATS),
        )


@dataclass
class DeviceConfig:
    """Where the model runs and with which attention backend.

    ``device="auto"`` and ``attention_backend=None`` are what a user may leave open;
    ``EngineArgs.create_engine_config`` resolves both before the graph policy runs (``cuda`` or
    ``cpu``, and a registered backend name), so the resolved config records what will run.
    Backend names are checked against the registry at that resolution.
    """

    device: str = "auto"
    attention_backend: str | None = None

    def __post_init__(self) -> None:
        check(self.device in DEVICES, "device", self.device, ", ".join(DEVICES))
        check(
            self.attention_backend is None or isinstance(self.attention_backend, str),
            "attention_backend",
            self.attention_backend,
            "a backend name or null (the platform's default)",
        )

    @property
    def is_resolved(self) -> bool:
        """Both the device and the attention backend are decided."""
        return self.device != "auto" and self.attention_backend is not None


@dataclass
class GraphOptimizationConfig:
    """CUDA graph settings; see ``docs/graph-optimization.md`` in the shared docs for semantics.

    Capture sizes: decode buckets count requests, prefill buckets count tokens. ``None`` means the
    default ladder (see :mod:`fastdeploy.model_executor.graph_optimization.capture_sizes`).
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

    def __post_init__(self) -> None:
        for name in ("use_cudagraph", "full_cuda_graph", "cudagraph_only_prefill"):
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
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"graph_optimization_config is not valid JSON: {e}") from None
        check(isinstance(value, dict), "graph_optimization_config", value, "a JSON object or dict")
        names = [f.name for f in dataclasses.fields(cls)]
        for key in value:
            if key not in names:
                raise unknown_key_error("graph_optimization_config key", key, names)
        return cls(**value)


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
