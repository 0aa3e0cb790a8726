"""Registry of attention backends: a name maps to a lazily imported class."""

from __future__ import annotations

import importlib
import importlib.util
import logging

from fastdeploy.model_executor.layers.attention.backend import AttentionBackend

logger = logging.getLogger(__name__)

_PKG = "fastdeploy.model_executor.layers.attention"
_BACKENDS = {
    "torch_native": f"{_PKG}.torch_native:TorchNativeAttentionBackend",
    "flashinfer": f"{_PKG}.flashinfer_backend:FlashInferAttentionBackend",
}


def backend_names() -> list[str]:
    """Names accepted by ``--attention-backend`` / ``FD_ATTENTION_BACKEND``."""
    return list(_BACKENDS)


def get_attention_backend_cls(name: str) -> type[AttentionBackend]:
    """Import and return the backend class called ``name``.

    Raises:
        ValueError: unknown name (the message lists the valid ones).
        ImportError: the backend's library is not installed.
    """
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; valid: {', '.join(_BACKENDS)}")
    module, cls = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def select_attention_backend(requested: str | None, device_type: str) -> type[AttentionBackend]:
    """The backend to use: ``requested`` if given; otherwise the platform's default
    (:attr:`fastdeploy.platforms.Platform.default_attention_backend`: flashinfer on CUDA, the
    torch-native backend on CPU). On CUDA without flashinfer installed, the default falls back to
    the torch-native backend with a warning. Called once, when the engine config is resolved.

    Raises:
        ValueError: unknown name or device, or flashinfer named on a CPU device.
    """
    from fastdeploy.platforms import get_platform

    platform = get_platform(device_type)
    if requested is not None:
        if requested == "flashinfer" and platform.name != "cuda":
            raise ValueError(
                "attention_backend='flashinfer' needs a CUDA device; on CPU use 'torch_native'"
            )
        return get_attention_backend_cls(requested)
    default = platform.default_attention_backend
    if default == "flashinfer" and importlib.util.find_spec("flashinfer") is None:
        logger.warning(
            "flashinfer is not installed; using the torch_native attention backend "
            "(pip install flashinfer-python)"
        )
        default = "torch_native"
    return get_attention_backend_cls(default)
