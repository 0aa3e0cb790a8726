"""Engine arguments: one flat dataclass that maps to the CLI and builds the :class:`FDConfig`.

Names follow FastDeploy's flags (``--max-num-seqs``, ``--graph-optimization-config``, ...).
Resolution is one pass: :meth:`EngineArgs.create_engine_config` turns the arguments into a validated
:class:`FDConfig` with the resolved model source (the model's config only, no weights), device and
attention backend; :func:`fastdeploy.config.resolve.resolve_deployment` then plans the deployment
once on that config. Build one ``EngineArgs`` per start.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastdeploy import envs
from fastdeploy.config import (
    CACHE_TRANSFER_PROTOCOLS,
    DEVICES,
    DTYPES,
    HOST_STORE_POLICIES,
    KV_LOAD_FAILURE_POLICIES,
    LOAD_FORMATS,
    PREFIX_CACHING_HASH_ALGOS,
    SPLITWISE_ROLES,
    SWAP_IN_MODES,
    CacheConfig,
    DeviceConfig,
    FDConfig,
    GraphOptimizationConfig,
    KVEventsConfig,
    LoadConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SplitwiseConfig,
    check,
    unknown_key_error,
)

if TYPE_CHECKING:
    from fastdeploy.model_executor.model_loader.source import ModelSource

# Fallback context length when neither the user nor the model's config gives one.
DEFAULT_MAX_MODEL_LEN = 2048
# Default per-step token budget: large enough to keep the device busy on prefill, small enough
# that a long prompt (chunked) does not stall the decode requests batched with it.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048

logger = logging.getLogger(__name__)


def _cli(
    help_text: str, arg_type: Any = None, choices: tuple[str, ...] | None = None
) -> dict[str, Any]:
    """Field metadata for :meth:`EngineArgs.add_cli_args`: help text, argparse type, choices."""
    return {"help": help_text, "type": arg_type, "choices": choices}


def _json_object(text: str) -> dict[str, Any]:
    """argparse type of ``--graph-optimization-config``: a JSON object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _split_peers(value: str | list[str] | None) -> list[str] | None:
    """``--pd-allowed-prefill``'s ``host:port,host:port`` as a list (a list passes through)."""
    if value is None or isinstance(value, list):
        return value
    return [p.strip() for p in str(value).split(",") if p.strip()]


@dataclass
class EngineArgs:
    """Everything a user can set when starting the engine, flat, with FastDeploy's names.

    ``None`` means "resolve at :meth:`create_engine_config`" for ``max_model_len`` and
    ``max_num_batched_tokens``, and "the default" elsewhere. Field values are validated by the
    config parts that :meth:`create_engine_config` builds.
    """

    model: str | None = field(
        default=None,
        metadata=_cli(
            "Hugging Face directory or .gguf file (default: the bundled SmolLM2-135M-Instruct)", str
        ),
    )
    tokenizer: str | None = field(
        default=None, metadata=_cli("tokenizer path or name (default: the model's)", str)
    )
    max_model_len: int | None = field(
        default=None,
        metadata=_cli(
            "context length in tokens, prompt + output (default: the model's "
            f"max_position_embeddings, or {DEFAULT_MAX_MODEL_LEN} when unknown)",
            int,
        ),
    )
    max_num_seqs: int = field(default=256, metadata=_cli("most requests in one step", int))
    max_num_batched_tokens: int | None = field(
        default=None,
        metadata=_cli(
            f"token budget of one step (default: max({DEFAULT_MAX_NUM_BATCHED_TOKENS}, "
            "max_num_seqs) with chunked prefill, and at least max_model_len without; at most "
            "max_num_seqs * max_model_len)",
            int,
        ),
    )
    block_size: int = field(default=64, metadata=_cli("tokens per KV cache block", int))
    gpu_memory_utilization: float = field(
        default=0.9, metadata=_cli("share of device memory the engine may use, in (0, 1]", float)
    )
    num_gpu_blocks_override: int | None = field(
        default=None, metadata=_cli("use this many KV blocks instead of profiling memory", int)
    )
    enable_chunked_prefill: bool = field(
        default=True, metadata=_cli("split long prompts across steps")
    )
    disable_overlap_schedule: bool = field(
        default=False,
        metadata=_cli(
            "schedule each step only after the previous one's tokens are on the host (default: "
            "off, so the host prepares step N+1 while the device runs step N where supported)"
        ),
    )
    scheduler_delay_factor: float = field(
        default=0.0,
        metadata=_cli(
            "while requests run, admit waiting prompts only once the oldest has waited more "
            "than this many times the last prompt latency (about one step), so that prompts "
            "arriving close together share one prefill step (vLLM's flag; default 0: at once)",
            float,
        ),
    )
    enable_prefix_caching: bool = field(
        default=True, metadata=_cli("reuse KV blocks of shared prompt prefixes")
    )
    prefix_caching_hash_algo: str = field(
        default="sha256",
        metadata=_cli(
            "hash function of the prefix cache's block hash chain (vLLM's flag and scheme: "
            "sha256 of the pickled (parent hash, block token ids, None); sha256_cbor: of its "
            "canonical CBOR)",
            str,
            PREFIX_CACHING_HASH_ALGOS,
        ),
    )
    kv_events_config: dict[str, Any] | str | None = field(
        default=None,
        metadata=_cli(
            "KV-cache events in vLLM's wire format as a JSON object with vLLM's fields, e.g. "
            '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
            '"replay_endpoint": "tcp://*:5558", "topic": "kv"}\' (default: None, events off)',
            _json_object,
        ),
    )
    dtype: str = field(default="auto", metadata=_cli("weight and activation dtype", str, DTYPES))
    load_format: str = field(default="auto", metadata=_cli("weight format", str, LOAD_FORMATS))
    seed: int = field(default=0, metadata=_cli("random seed", int))
    graph_optimization_config: dict[str, Any] | str | None = field(
        default=None,
        metadata=_cli(
            "CUDA graph settings as a JSON object, e.g. "
            '\'{"use_cudagraph": true, "full_cuda_graph": false}\'',
            _json_object,
        ),
    )
    splitwise_role: str = field(
        default="mixed",
        metadata=_cli("prefill/decode disaggregation role", str, SPLITWISE_ROLES),
    )
    swap_space: float = field(
        default=0, metadata=_cli("host (CPU) KV cache tier in GiB; 0: none", float)
    )
    swap_in_mode: str = field(
        default="request",
        metadata=_cli(
            "how host KV hits come back: per request before its first step, or per layer "
            "inside the forward (turns prefill graphs off)",
            str,
            SWAP_IN_MODES,
        ),
    )
    host_store_policy: str = field(
        default="prompt",
        metadata=_cli(
            "which full blocks are written through to the host tier", str, HOST_STORE_POLICIES
        ),
    )
    tensor_parallel_size: int = field(default=1, metadata=_cli("tensor parallel ranks", int))
    dist_init_addr: str | None = field(
        default=None,
        metadata=_cli(
            "host:port where tensor parallel ranks meet (default: a free local port)", str
        ),
    )
    nnodes: int = field(default=1, metadata=_cli("hosts the tensor parallel ranks span", int))
    node_rank: int = field(default=0, metadata=_cli("this host's index among --nnodes", int))
    enable_flashinfer_allreduce_fusion: bool = field(
        default=False,
        metadata=_cli("fuse all-reduce + residual add + RMSNorm with flashinfer (CUDA, TP > 1)"),
    )
    pd_comm_port: int | None = field(
        default=None,
        metadata=_cli(
            "port of the prefill/decode control side channel (default: a free port)", int
        ),
    )
    pd_host: str = field(
        default="127.0.0.1",
        metadata=_cli("address this prefill/decode node advertises to its peers", str),
    )
    cache_transfer_protocol: str = field(
        default="auto",
        metadata=_cli(
            "KV transport between prefill and decode nodes (auto: nixl when installed, else tcp)",
            str,
            CACHE_TRANSFER_PROTOCOLS,
        ),
    )
    pd_lease_s: float = field(
        default=30.0,
        metadata=_cli("seconds a prefill node holds unclaimed KV blocks for a decode node", float),
    )
    kv_load_failure_policy: str = field(
        default="fail",
        metadata=_cli(
            "on a failed KV transfer, the decode node answers 5xx (fail) or prefills itself "
            "(recompute)",
            str,
            KV_LOAD_FAILURE_POLICIES,
        ),
    )
    pd_decode_wait_timeout: float = field(
        default=30.0,
        metadata=_cli("seconds a decode-leg request waits for KV blocks before a 503", float),
    )
    pd_transfer_timeout: float = field(
        default=30.0, metadata=_cli("deadline in seconds of one KV pull (CLAIM, read, DONE)", float)
    )
    pd_secret_file: str | None = field(
        default=None,
        metadata=_cli(
            "file holding the secret that prefill nodes, decode nodes and the router share; it "
            "signs every PD control message, tcp KV read and KV reference (default: the "
            "FD_PD_SECRET environment variable; neither: PD is unauthenticated and a warning "
            "is logged)",
            str,
        ),
    )
    pd_allowed_prefill: str | None = field(
        default=None,
        metadata=_cli(
            "decode node: the prefill nodes it pulls KV from, as host:port,... of their "
            "--pd-host and --pd-comm-port; any other kv_transfer_params address is a 400 "
            "(default: any prefill node that proves the PD secret; without a secret, loopback "
            "ones only)",
            str,
        ),
    )
    pd_max_connections: int = field(
        default=256,
        metadata=_cli(
            "connections served at once by the PD side channel and by the tcp KV port, each; "
            "more are refused and counted",
            int,
        ),
    )
    pd_max_hold_s: float = field(
        default=300.0,
        metadata=_cli(
            "prefill node: longest time heartbeats may keep a finished request's KV blocks "
            "held for a decode node",
            float,
        ),
    )
    device: str = field(default="auto", metadata=_cli("device to run on", str, DEVICES))
    attention_backend: str | None = field(
        default=None,
        metadata=_cli(
            "attention backend name (default: FD_ATTENTION_BACKEND, else the platform's)", str
        ),
    )
    skip_tokenizer_init: bool = field(
        default=False,
        metadata=_cli("load no tokenizer: prompts are token ids and outputs carry no text"),
    )

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        """Build from keyword arguments (``LLM(model=..., max_num_seqs=...)``).

        Raises:
            ValueError: an unknown argument, naming it and the close matches.
        """
        names = [f.name for f in dataclasses.fields(cls)]
        for key in kwargs:
            if key not in names:
                raise unknown_key_error("engine argument", key, names)
        return cls(**kwargs)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Add every field as a ``--kebab-case`` flag (bools also ``--no-...``); returns parser."""
        group = parser.add_argument_group("engine")
        for f in dataclasses.fields(EngineArgs):
            flag = "--" + f.name.replace("_", "-")
            meta = f.metadata
            help_text = (
                meta["help"]
                if "default:" in meta["help"]
                else f"{meta['help']} (default: {f.default})"
            )
            if isinstance(f.default, bool):
                group.add_argument(
                    flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_text
                )
            else:
                group.add_argument(
                    flag,
                    type=meta["type"],
                    choices=meta["choices"],
                    default=f.default,
                    help=help_text,
                )
        return parser

    @classmethod
    def from_cli_args(cls, namespace: argparse.Namespace) -> EngineArgs:
        """Build from parsed arguments; other attributes (``--port``, ...) are ignored."""
        values = vars(namespace)
        return cls(**{f.name: values[f.name] for f in dataclasses.fields(cls) if f.name in values})

    def resolve_max_model_len(self, hf_max_position_embeddings: int | None) -> int:
        """``max_model_len``, or the model's maximum, or ``DEFAULT_MAX_MODEL_LEN`` when unknown.

        Raises:
            ValueError: an explicit value above the model's ``max_position_embeddings``.
        """
        if self.max_model_len is None:
            return hf_max_position_embeddings or DEFAULT_MAX_MODEL_LEN
        if hf_max_position_embeddings is not None:
            check(
                self.max_model_len <= hf_max_position_embeddings,
                "max_model_len",
                self.max_model_len,
                f"<= the model's max_position_embeddings={hf_max_position_embeddings}",
            )
        return self.max_model_len

    def resolve_max_num_batched_tokens(self, max_model_len: int) -> int:
        """``max_num_batched_tokens``, or its default.

        With chunked prefill the default is ``max(2048, max_num_seqs)``; without it
        ``max(max_model_len, 2048, max_num_seqs)``, since a whole prompt must then fit one step.
        An explicit value is kept as given (and checked by :meth:`FDConfig.validate`), except
        that it, like the default, is capped at ``max_num_seqs * max_model_len``: no step can
        hold more tokens, so the cap changes no schedule, but the start-up profile step and the
        prefill graph buckets are sized by the budget, and a larger one would ask a request to
        hold more than ``max_model_len`` tokens. An explicit value above the cap is logged.
        """
        most = self.max_num_seqs * max_model_len
        if self.max_num_batched_tokens is not None:
            if self.max_num_batched_tokens > most:
                logger.info(
                    "max_num_batched_tokens=%d capped at max_num_seqs * max_model_len = %d, "
                    "the most tokens one step can hold",
                    self.max_num_batched_tokens,
                    most,
                )
            return min(self.max_num_batched_tokens, most)
        budget = max(DEFAULT_MAX_NUM_BATCHED_TOKENS, self.max_num_seqs)
        if not self.enable_chunked_prefill:
            budget = max(budget, max_model_len)
        return min(budget, most)

    def resolve_device(self) -> str:
        """``cuda`` or ``cpu``: ``--device`` as given, or (``auto``) CUDA when available.

        Raises:
            ValueError: an unknown device name.
        """
        check(self.device in DEVICES, "device", self.device, ", ".join(DEVICES))
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def create_engine_config(self, model_source: ModelSource | None = None) -> FDConfig:
        """Resolve these arguments, in one pass, into a validated :class:`FDConfig`.

        Resolves the model (``model_source``: reads only the model's config, no weights; taken
        as given when passed), ``max_model_len`` and ``max_num_batched_tokens`` (see
        :meth:`resolve_max_model_len` and :meth:`resolve_max_num_batched_tokens`), the device
        (:meth:`resolve_device`) and the attention backend (``--attention-backend``, else
        ``FD_ATTENTION_BACKEND``, else the platform's default; see
        :func:`~fastdeploy.model_executor.layers.attention.selector.select_attention_backend`).
        :func:`~fastdeploy.config.resolve.resolve_deployment` calls this, then plans the
        deployment on the result. Does not refuse settings that are not supported
        yet (:meth:`FDConfig.check_supported` does), so their plan can still be printed.

        Args:
            model_source: an already resolved model (tests, or a caller that resolved it); None
                resolves ``model`` / ``load_format`` / ``tokenizer``.

        Raises:
            ValueError: a field out of range, an unknown attention backend or an inconsistent
                combination, naming the field, the value and the limit.
            FileNotFoundError: the model does not exist.
        """
        from fastdeploy.model_executor.layers.attention.selector import select_attention_backend

        # Build the parts from the raw values first, so types are checked before they are used.
        model_config = ModelConfig(
            model=self.model,
            tokenizer=self.tokenizer,
            dtype=self.dtype,
            max_model_len=self.max_model_len,
            seed=self.seed,
            skip_tokenizer_init=self.skip_tokenizer_init,
        )
        scheduler_config = SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            enable_chunked_prefill=self.enable_chunked_prefill,
            disable_overlap_schedule=self.disable_overlap_schedule,
            scheduler_delay_factor=self.scheduler_delay_factor,
        )
        load_config = LoadConfig(load_format=self.load_format)
        cache_config = CacheConfig(
            block_size=self.block_size,
            gpu_memory_utilization=self.gpu_memory_utilization,
            num_gpu_blocks_override=self.num_gpu_blocks_override,
            swap_space=self.swap_space,
            enable_prefix_caching=self.enable_prefix_caching,
            swap_in_mode=self.swap_in_mode,
            host_store_policy=self.host_store_policy,
            prefix_caching_hash_algo=self.prefix_caching_hash_algo,
        )
        kv_events_config = KVEventsConfig.from_value(self.kv_events_config)
        if kv_events_config.enable_kv_cache_events and not self.enable_prefix_caching:
            # vLLM (VllmConfig) warns likewise: no block enters a prefix cache, so none is stored
            logger.warning(
                "kv_events_config.enable_kv_cache_events is true but prefix caching is off: no "
                "BlockStored/BlockRemoved event will be published; drop --no-enable-prefix-caching"
            )
        parallel_config = ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            splitwise_role=self.splitwise_role,
            dist_init_addr=self.dist_init_addr,
            nnodes=self.nnodes,
            node_rank=self.node_rank,
            enable_flashinfer_allreduce_fusion=self.enable_flashinfer_allreduce_fusion,
        )
        splitwise_config = SplitwiseConfig(
            pd_comm_port=self.pd_comm_port,
            pd_host=self.pd_host,
            cache_transfer_protocol=self.cache_transfer_protocol,
            pd_lease_s=self.pd_lease_s,
            kv_load_failure_policy=self.kv_load_failure_policy,
            pd_decode_wait_timeout=self.pd_decode_wait_timeout,
            pd_transfer_timeout=self.pd_transfer_timeout,
            pd_secret_file=self.pd_secret_file,
            pd_allowed_prefill=_split_peers(self.pd_allowed_prefill),
            pd_max_connections=self.pd_max_connections,
            pd_max_hold_s=self.pd_max_hold_s,
        )
        graph_opt_config = GraphOptimizationConfig.from_value(self.graph_optimization_config)
        device = self.resolve_device()
        backend = select_attention_backend(
            self.attention_backend or envs.FD_ATTENTION_BACKEND(), device
        ).name
        if model_source is None:  # last: the only step that reads a file
            from fastdeploy.model_executor.model_loader.source import resolve_model

            model_source = resolve_model(self.model, self.load_format, self.tokenizer)
        hf_max = getattr(model_source.hf_config, "max_position_embeddings", None)
        max_model_len = self.resolve_max_model_len(hf_max)
        # No --model: record what the default resolved to (the bundled GGUF file), so the config
        # (--print-config, /v1/server_info) names the weights that run.
        model = self.model if self.model is not None else model_source.weights_path
        return FDConfig(
            model_config=dataclasses.replace(
                model_config, model=model, max_model_len=max_model_len
            ),
            cache_config=cache_config,
            parallel_config=parallel_config,
            splitwise_config=splitwise_config,
            scheduler_config=dataclasses.replace(
                scheduler_config,
                max_num_batched_tokens=self.resolve_max_num_batched_tokens(max_model_len),
            ),
            load_config=load_config,
            device_config=DeviceConfig(device=device, attention_backend=backend),
            graph_opt_config=graph_opt_config,
            kv_events_config=kv_events_config,
            model_source=model_source,
        )
