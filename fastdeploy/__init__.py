"""FastDeploy-style LLM serving engine on PyTorch: paged KV cache, continuous batching, CUDA graphs.

``from fastdeploy import LLM, SamplingParams`` is the offline API; ``fastdeploy serve`` the server.
"""

from __future__ import annotations

from fastdeploy import envs as _envs
from fastdeploy.core import cpu_threads as _cpu_threads
from fastdeploy.core.version import __version__

# Before anything of fastdeploy imports torch: its OpenMP pool reads the wait policy once.
_cpu_threads.set_engine_thread_env()

__all__ = ["LLM", "SamplingParams", "__version__"]

_envs.apply_log_level()


def __getattr__(name: str):
    # Lazy, so `import fastdeploy` (CLI start-up, --print-config) does not import torch models.
    if name == "LLM":
        from fastdeploy.entrypoints.llm import LLM

        return LLM
    if name == "SamplingParams":
        from fastdeploy.core.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'fastdeploy' has no attribute {name!r}")
