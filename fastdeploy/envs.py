"""Every ``FD_*`` environment variable of the engine, typed and documented in one place.

Each variable is a module-level :class:`EnvVar`; call it to read ``os.environ`` now (lazily, so a
test's ``monkeypatch.setenv`` or a launcher's edit made after import is honoured)::

    from fastdeploy import envs

    if envs.FD_DEBUG_CUDAGRAPH_ADDRESSES():
        ...

Forgetting the call is caught: an :class:`EnvVar` used as a truth value raises ``TypeError``.
A set but malformed value raises ``ValueError`` naming the variable, the value and what is allowed.
An empty value counts as unset. To add a variable, add one ``EnvVar`` below.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def parse_bool(name: str, raw: str) -> bool:
    """``1/true/yes/on`` -> True, ``0/false/no/off`` -> False, any case; else ValueError."""
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r} is invalid; allowed: {', '.join(_TRUE + _FALSE)}")


def is_false_value(raw: str) -> bool:
    """True for the spellings of "off" that :func:`parse_bool` accepts (``0``, ``false``, ...)."""
    return raw.strip().lower() in _FALSE


def _parse_str(name: str, raw: str) -> str:
    return raw


def _parse_positive_float(name: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0:  # also rejects nan
        raise ValueError(f"{name}={raw!r} is invalid; allowed: a number > 0")
    return value


def _parse_share(name: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 < value <= 1:  # also rejects nan
        raise ValueError(f"{name}={raw!r} is invalid; allowed: a number > 0 and <= 1")
    return value


def _parse_log_level(name: str, raw: str) -> str:
    value = raw.strip().upper()
    if value not in LOG_LEVELS:
        raise ValueError(f"{name}={raw!r} is invalid; allowed: {', '.join(LOG_LEVELS)}")
    return value


@dataclass(frozen=True)
class EnvVar:
    """One environment variable: how to parse it, its value when unset, and what it does."""

    name: str
    type: str
    parse: Callable[[str, str], Any]
    default: Any
    doc: str

    def __call__(self) -> Any:
        """The current, parsed value; see :meth:`read`."""
        return self.read()

    def __bool__(self) -> bool:
        raise TypeError(f"envs.{self.name} is a variable, not its value: call envs.{self.name}()")

    def read(self) -> Any:
        """The current, parsed value (``default`` when unset or empty).

        Raises:
            ValueError: the variable is set to a value its type does not accept.
        """
        raw = os.environ.get(self.name)
        if raw is None or raw == "":
            return self.default
        return self.parse(self.name, raw)


FD_USE_BLOCK_WISE_CUDA_GRAPH = EnvVar(
    "FD_USE_BLOCK_WISE_CUDA_GRAPH",
    "str | None",
    _parse_str,
    None,
    "Legacy switch of the removed block-wise CUDA graphs, kept raw so that unset and '0' differ. "
    "A true value stops start-up (piecewise graphs replace them: graph_optimization_config "
    '{"full_cuda_graph": false}, the default); "0" only warns.',
)
FD_BLOCK_WISE_CUDA_GRAPH_SIZES = EnvVar(
    "FD_BLOCK_WISE_CUDA_GRAPH_SIZES",
    "str | None",
    _parse_str,
    None,
    'Legacy capture sizes of the removed block-wise CUDA graphs, kept raw. Any value but "0" '
    'stops start-up (use cudagraph_capture_sizes_prefill); "0" only warns.',
)
FD_ATTENTION_BACKEND = EnvVar(
    "FD_ATTENTION_BACKEND",
    "str | None",
    _parse_str,
    None,
    "Attention backend name used when --attention-backend is not given; None picks the "
    "platform's default. An unknown name is reported by the backend registry.",
)
FD_DEBUG_CUDAGRAPH_ADDRESSES = EnvVar(
    "FD_DEBUG_CUDAGRAPH_ADDRESSES",
    "bool",
    parse_bool,
    False,
    "Debug: before every CUDA graph replay, assert that each input tensor's data pointer equals "
    "the one seen at capture (catches buffers re-allocated instead of copied into).",
)
FD_CPU_KV_CACHE_SPACE = EnvVar(
    "FD_CPU_KV_CACHE_SPACE",
    "float",
    _parse_positive_float,
    1.0,
    "GiB of host memory given to the KV cache when the model runs on the CPU platform. The "
    "default fits a laptop: about 23,000 tokens of SmolLM2-135M's float32 KV, a server of "
    "about 2 GB; the start-up log says how many tokens it holds.",
)
FD_LOG_LEVEL = EnvVar(
    "FD_LOG_LEVEL",
    "str",
    _parse_log_level,
    "INFO",
    "Level of the 'fastdeploy' loggers when set: " + ", ".join(LOG_LEVELS) + " (case-insensitive); "
    "applied when fastdeploy is imported. Unset, they follow the root logger (the server's "
    "--log-level).",
)

FD_API_KEY = EnvVar(
    "FD_API_KEY",
    "str | None",
    _parse_str,
    None,
    "The API key of `fastdeploy serve` and `fastdeploy router` when --api-key is not given "
    "(then VLLM_API_KEY, vLLM's variable, is read); clients send it as 'Authorization: Bearer "
    "<key>'. The environment keeps the key out of the process list.",
)

FD_BACKEND_API_KEY = EnvVar(
    "FD_BACKEND_API_KEY",
    "str | None",
    _parse_str,
    None,
    "The key `fastdeploy router` sends to its backends when --backend-api-key is not given.",
)

FD_USE_FUSED_OPS = EnvVar(
    "FD_USE_FUSED_OPS",
    "bool",
    parse_bool,
    True,
    "On CUDA with flashinfer installed, run RMSNorm, fused add + RMSNorm, RoPE and "
    "SiLU-and-multiply as flashinfer kernels (one kernel each). 0 runs the torch reference ops "
    "everywhere (several elementwise kernels each; benchmarks use it to count the difference). "
    "Read once per process, when the first such layer runs.",
)

FD_USE_SKINNY_GEMM = EnvVar(
    "FD_USE_SKINNY_GEMM",
    "bool",
    parse_bool,
    True,
    "On CUDA with Triton, run linear layers without bias whose input has at most 16 rows (decode "
    "at small batches, short prefills) as the project's Triton kernel "
    "(custom_ops/skinny_gemm.py) instead of cuBLAS. 0 keeps cuBLAS. Read once per process, when "
    "the first such layer runs.",
)

FD_SKINNY_GEMM_PDL = EnvVar(
    "FD_SKINNY_GEMM_PDL",
    "bool",
    parse_bool,
    True,
    "On sm90 and newer GPUs with Triton 3.4+, launch the skinny GEMM (FD_USE_SKINNY_GEMM) and "
    "the fused RoPE + KV write as programmatic dependent launches: the next kernel (if a PDL "
    "launch too, as flashinfer's are) is launched while one runs and it waits on the previous "
    "one on the device, which hides the launch gap between a decode step's kernels (H200, graph "
    "decode at batch 1: Llama-3-8B 4.52 -> 4.44 ms, SmolLM2-135M 1.05 -> 0.85 for the GEMM; the "
    "RoPE kernel's decode graph 4.24 -> 4.17 and 0.82 -> 0.77 ms; it launches so also with "
    "FD_USE_SKINNY_GEMM=0). 0: plain launches. Read once per process and device.",
)

FD_GRAPH_CAPTURE_BUSY_SHARE = EnvVar(
    "FD_GRAPH_CAPTURE_BUSY_SHARE",
    "float",
    _parse_share,
    1 / 3,
    "While CUDA graphs are captured in the background (capture_in_background) and requests "
    "run, the most of the wall clock that capture may take: after a capture of c seconds the "
    "engine runs steps for c * (1 - share) / share seconds before the next. Higher finishes "
    "capture sooner under load, lower keeps the time per token closer to steady state; an "
    "idle engine always captures back to back.",
)

FD_GC_FREEZE = EnvVar(
    "FD_GC_FREEZE",
    "bool",
    parse_bool,
    True,
    "Once an engine has started (and once the API server has), collect garbage and freeze the "
    "objects alive (gc.freeze), so later full collections skip the start-up heap: a full "
    "collection of it took 113 ms on a 2-core VM and stalled every stream. The cost: a "
    "reference cycle through an object alive at start-up is freed only at the engine's "
    "shutdown, not by gc.collect() (see fastdeploy/core/gc_heap.py). 0: no freeze.",
)

FD_FLASHINFER_USE_TENSOR_CORES = EnvVar(
    "FD_FLASHINFER_USE_TENSOR_CORES",
    "bool | None",
    parse_bool,
    None,
    "Decode attention on flashinfer's tensor-core kernel (1) or its CUDA-core decode kernel (0). "
    "Unset, the backend picks by the GQA group size (query heads per KV head; see "
    "FlashInferAttentionBackend). 0 with a group the CUDA-core kernel lacks (only 1, 2, 3, 4 "
    "and 8 exist) stops start-up. The same switch as SGLang's SGLANG_FLASHINFER_USE_TENSOR_CORE.",
)

FD_FLASHINFER_DIRECT_PLAN = EnvVar(
    "FD_FLASHINFER_DIRECT_PLAN",
    "bool",
    parse_bool,
    True,
    "Plan prefill and mixed steps, and CUDA-graph decode steps on the CUDA-core kernel, without "
    "flashinfer's Python plan() where the wrapper is the one this was written for (flashinfer "
    "0.5.3; prefill: fa2 backend): the step's attributes are set and the compiled scheduler is "
    "called directly, with the arrays moved in one packed copy "
    "(fastdeploy/model_executor/layers/attention/flashinfer_plan.py). 0: every plan through "
    "plan(). Read when the backend is built.",
)

FD_PD_SECRET = EnvVar(
    "FD_PD_SECRET",
    "str | None",
    _parse_str,
    None,
    "The shared secret of prefill/decode peers (prefill node, decode node, fastdeploy router) when "
    "--pd-secret-file is not given: it signs every side-channel message, tcp KV read and KV "
    "reference (HMAC-SHA256). At least 16 bytes. Unset: PD runs unauthenticated (a warning).",
)

FD_STRUCTURED_OUTPUT_COMPILE_TIMEOUT_S = EnvVar(
    "FD_STRUCTURED_OUTPUT_COMPILE_TIMEOUT_S",
    "float",
    _parse_positive_float,
    30.0,
    "Seconds a structured-output request may wait for its grammar to compile before it fails "
    "with a 400 naming the limit. The request waits outside the scheduler, so other requests "
    "run meanwhile; the compile itself cannot be stopped and finishes on its thread (xgrammar's "
    "JSON-schema compile grows fast with the optional properties of one object: 1,000 took "
    "1.7 s on the 2-core CI host, 4,000 took 198 s).",
)

_VARS: dict[str, EnvVar] = {v.name: v for v in globals().copy().values() if isinstance(v, EnvVar)}


def get(name: str) -> Any:
    """The current value of the variable ``name``.

    Raises:
        KeyError: ``name`` is not one of the engine's variables (the message lists them).
        ValueError: the variable is set to a malformed value.
    """
    if name not in _VARS:
        raise KeyError(f"unknown environment variable {name!r}; known: {', '.join(sorted(_VARS))}")
    return _VARS[name].read()


def describe() -> list[EnvVar]:
    """All variables, sorted by name (for ``--help`` epilogues and documentation)."""
    return [_VARS[n] for n in sorted(_VARS)]


def apply_log_level() -> None:
    """Set the level of the ``fastdeploy`` logger (and so of every module logger under it) from
    ``FD_LOG_LEVEL`` when that variable is set; unset, leave it to inherit from the root logger.

    Raises:
        ValueError: ``FD_LOG_LEVEL`` is set to an unknown level.
    """
    if os.environ.get(FD_LOG_LEVEL.name):
        import logging

        logging.getLogger("fastdeploy").setLevel(FD_LOG_LEVEL())
