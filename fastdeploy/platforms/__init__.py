"""What the current device can do, behind a small registry (``cuda``, ``cpu``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Platform:
    """Capabilities of one device kind.

    Attributes:
        name: ``cuda`` or ``cpu``.
        can_capture_graphs: CUDA graphs can be captured and replayed.
        default_attention_backend: the backend used when none is named.
        default_dtype: activation dtype for ``dtype="auto"`` (float32 on CPU, where it is also the
            numerical reference; bfloat16 on CUDA).
        collective_backend: the ``torch.distributed`` backend of tensor collectives across
            tensor-parallel ranks (``nccl`` on CUDA, ``gloo`` on CPU).
    """

    name: str
    can_capture_graphs: bool
    default_attention_backend: str
    default_dtype: torch.dtype
    collective_backend: str


_PLATFORMS = {
    "cuda": Platform("cuda", True, "flashinfer", torch.bfloat16, "nccl"),
    "cpu": Platform("cpu", False, "torch_native", torch.float32, "gloo"),
}


def get_platform(name: str) -> Platform:
    """The platform called ``name``.

    Raises:
        ValueError: unknown name; the message lists the valid ones.
    """
    if name not in _PLATFORMS:
        raise ValueError(f"unknown platform {name!r}; valid: {', '.join(_PLATFORMS)}")
    return _PLATFORMS[name]
