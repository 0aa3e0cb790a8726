"""The engine paths the harness compares with HF: each a set of engine arguments and ``FD_*``
environment variables (names from ``fastdeploy/engine/args_utils.py`` and ``fastdeploy/envs.py``).

Every path but ``prefix-hit`` and the host tier runs with the prefix cache off, so that a path
measures only what its name says. Paths marked ``needs_cuda`` change nothing on the CPU platform
(no CUDA graphs, no flashinfer fused ops, no Triton skinny GEMM there); on CPU they are listed as
"needs CUDA" instead of being run.

What a path's measures exercise: the greedy requests (tokens and their log-probs) run the path's
feature. The teacher-forced requests (``prompt_logprobs``) do too, except for cache hits: by the
engine's rule (vLLM's) such a request never reads the prefix cache or the host tier, so on
``prefix-hit`` and ``host-*`` only the greedy columns (and ``gen |Δlp|``) measure the hits. A PD
role refuses ``prompt_logprobs``, so ``pd-tcp`` has greedy columns only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

#: The plain torch path: the bfloat16 rule's yardstick (docs/accuracy.md).
TORCH_PATH = "torch"
_NO_GRAPHS = {"graph_optimization_config": {"use_cudagraph": False}}
_GRAPHS = {"graph_optimization_config": {"use_cudagraph": True, "full_cuda_graph": False}}
#: Block size of the paths that need several blocks per short prompt (hits, preemption).
SMALL_BLOCK = 16


@dataclass(frozen=True)
class PathSpec:
    """One path.

    ``dtype``: this path's own dtype whatever ``--dtype`` says (the tiny MoE: float32).
    ``repeat``: run the greedy prompts twice and score the second pass (prefix-cache or host-tier
    hits). ``tight_pool``: size the KV pool to one request's worst case plus two blocks, so that a
    batch cannot fit and requests are preempted. ``evidence``: the engine counter that must be > 0
    for the path to have tested what it claims (``num_preemptions``, ``num_cached_tokens``,
    ``host_cache_hit_tokens``, ``kv_transfers``). ``model``: ``default`` (the GGUF) or ``tiny-moe``.
    ``switching``: run on an engine that captures its graphs between the steps of these
    requests (:mod:`accuracy.switching`).
    """

    name: str
    description: str
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    needs_cuda: bool = False
    repeat: bool = False
    tight_pool: bool = False
    evidence: str | None = None
    model: str = "default"
    pd: bool = False
    dtype: str | None = None
    switching: bool = False


def _host(mode: str) -> PathSpec:
    return PathSpec(
        f"host-{mode}",
        f"host KV tier, swap-in by {mode}: tight device pool, prompts run twice",
        {**_NO_GRAPHS, "enable_prefix_caching": True, "swap_in_mode": mode,
         "block_size": SMALL_BLOCK},
        repeat=True, tight_pool=True, evidence="host_cache_hit_tokens",
    )  # fmt: skip


PATHS: dict[str, PathSpec] = {
    p.name: p
    for p in [
        PathSpec(TORCH_PATH, "eager, fused ops off, skinny GEMM off (the yardstick)",
                 _NO_GRAPHS, {"FD_USE_FUSED_OPS": "0", "FD_USE_SKINNY_GEMM": "0"}),
        PathSpec("eager", "graphs off (use_cudagraph=false), other defaults", _NO_GRAPHS),
        PathSpec("piecewise", "piecewise prefill graphs + full decode graphs (the default)",
                 _GRAPHS, needs_cuda=True),
        PathSpec("full-decode-graph", "full_cuda_graph=true: decode graphs, eager prefill",
                 {"graph_optimization_config": {"full_cuda_graph": True}}, needs_cuda=True),
        PathSpec("overlap-on", "graphs as the platform allows, overlap schedule on", _GRAPHS),
        PathSpec("overlap-off", "as overlap-on with disable_overlap_schedule=true",
                 {**_GRAPHS, "disable_overlap_schedule": True}),
        PathSpec("capture-switch", "graphs captured in the background between the steps of "
                 "the requests (one per step), which enter one per step",
                 {"graph_optimization_config": {"use_cudagraph": True,
                                                "capture_in_background": True}},
                 needs_cuda=True, switching=True, evidence="graph_switches"),
        PathSpec("fused-on", "graphs, FD_USE_FUSED_OPS=1", _GRAPHS, {"FD_USE_FUSED_OPS": "1"},
                 needs_cuda=True),
        PathSpec("fused-off", "graphs, FD_USE_FUSED_OPS=0", _GRAPHS, {"FD_USE_FUSED_OPS": "0"},
                 needs_cuda=True),
        PathSpec("skinny-on", "graphs, FD_USE_SKINNY_GEMM=1", _GRAPHS,
                 {"FD_USE_SKINNY_GEMM": "1"}, needs_cuda=True),
        PathSpec("skinny-off", "graphs, FD_USE_SKINNY_GEMM=0", _GRAPHS,
                 {"FD_USE_SKINNY_GEMM": "0"}, needs_cuda=True),
        PathSpec("chunked", "chunked prefill, 48-token step budget, 16 requests",
                 {**_NO_GRAPHS, "max_num_batched_tokens": 48, "max_num_seqs": 16}),
        PathSpec("prefix-hit", "prefix cache on, block 16, prompts run twice, second scored",
                 {**_NO_GRAPHS, "enable_prefix_caching": True, "block_size": SMALL_BLOCK},
                 repeat=True, evidence="num_cached_tokens"),
        PathSpec("preemption", "tight KV pool (num_gpu_blocks_override), block 16",
                 {**_NO_GRAPHS, "block_size": SMALL_BLOCK}, tight_pool=True,
                 evidence="num_preemptions"),
        PathSpec("pd-tcp", "prefill + decode engines in one process, KV over tcp",
                 {**_NO_GRAPHS, "cache_transfer_protocol": "tcp"}, pd=True,
                 evidence="kv_transfers"),
        _host("request"),
        _host("layerwise"),
        # float32 (the rule for random weights: exact) with the torch-native attention,
        # which runs float32 on CUDA too; flashinfer's prefill also has no kernel for its
        # head_dim of 32 (the H200 run of 2026-12-04 raised "Invalid configuration").
        PathSpec("moe", "tiny random-weight Qwen3-MoE, float32, torch-native attention",
                 {**_NO_GRAPHS, "attention_backend": "torch_native"}, model="tiny-moe",
                 dtype="float32"),
    ]
}  # fmt: skip
#: What the CPU tests and a CPU run without ``--paths`` run (every path without needs_cuda).
CPU_PATHS = [name for name, p in PATHS.items() if not p.needs_cuda]


def parse_paths(text: str | None) -> list[PathSpec]:
    """``--paths a,b,c`` (None or ``all``: every path), in :data:`PATHS` order.

    Raises:
        ValueError: an unknown name, listing the valid ones.
    """
    if text is None or text == "all":
        return list(PATHS.values())
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in PATHS]
    if unknown:
        raise ValueError(f"unknown path(s) {unknown}; valid: {', '.join(PATHS)}")
    return [p for n, p in PATHS.items() if n in names]  # the torch yardstick runs first


def engine_kwargs(
    spec: PathSpec,
    *,
    dtype: str,
    device: str,
    prompt_lengths: list[int],
    text_length: int,
    max_new_tokens: int,
    kv_bytes_per_token: int,
) -> dict[str, Any]:
    """The ``LLM(...)`` keyword arguments of one path for one workload.

    The KV pool is sized from the workload, not from free memory (so a CPU run does not allocate
    ``FD_CPU_KV_CACHE_SPACE`` and a roomy path never preempts): roomy = every request at once;
    tight (``spec.tight_pool``) = the largest single request plus two blocks. The host tier gets
    room for every prompt's blocks twice over (``swap_space`` in GiB, from
    ``kv_bytes_per_token``: bytes of K and V over all layers for one token).
    """
    kw: dict[str, Any] = {"enable_prefix_caching": False, **spec.engine_kwargs}
    block = kw.get("block_size", 64)
    longest = max(prompt_lengths + [text_length]) + max_new_tokens
    per_request = [math.ceil((n + max_new_tokens) / block) for n in prompt_lengths]
    text_blocks = math.ceil((text_length + 1) / block)
    if spec.tight_pool:
        blocks = max(per_request + [text_blocks]) + 2
    else:
        blocks = max(sum(per_request), text_blocks) + 2
    kw.update(
        dtype=dtype,
        device=device,
        seed=0,
        skip_tokenizer_init=True,
        max_model_len=longest + 1,
        num_gpu_blocks_override=blocks,
    )
    if "swap_in_mode" in kw:
        total = sum(prompt_lengths) + text_length
        kw["swap_space"] = max(2 * total * kv_bytes_per_token / 2**30, 0.001)
    return kw
