"""Building a model and filling its weights: :func:`get_model`."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from fastdeploy.model_executor.model_loader.source import ModelSource
from fastdeploy.model_executor.models.registry import resolve_model_class

logger = logging.getLogger(__name__)

__all__ = ["ModelSource", "get_model", "load_model"]


def _weights(path: Path, load_format: str, hf_config: Any):
    if load_format == "gguf":
        from fastdeploy.model_executor.model_loader.gguf_loader import count_gguf, iterate_gguf

        return count_gguf(path), iterate_gguf(path, hf_config)
    from fastdeploy.model_executor.model_loader.safetensors_loader import (
        count_safetensors,
        iterate_safetensors,
    )

    return count_safetensors(path), iterate_safetensors(path)


def get_model(model: ModelSource | str | Path, *args: Any, **kwargs: Any) -> nn.Module:
    """Build a model on its device, load its weights, and return it in eval mode.

    Two call forms:

    - ``get_model(source: ModelSource, dtype, device, seed=0)``, the resolved model from
      :func:`~fastdeploy.model_executor.model_loader.source.resolve_model`;
    - ``get_model(model_path_or_file, load_format, hf_config, dtype, device, seed=0)``, see
      :func:`load_model`.
    """
    if isinstance(model, ModelSource):
        return load_model(model.weights_path, model.load_format, model.hf_config, *args, **kwargs)
    return load_model(model, *args, **kwargs)


def load_model(
    model_path_or_file: str | Path,
    load_format: str,
    hf_config: Any,
    dtype: torch.dtype,
    device: str | torch.device,
    seed: int = 0,
) -> nn.Module:
    """Build the model for ``hf_config`` on ``device`` and load its weights; eval mode.

    Args:
        model_path_or_file: a safetensors directory or a ``.gguf`` file (see
            :attr:`~fastdeploy.model_executor.model_loader.source.ModelSource.weights_path`);
            not read for ``dummy``.
        load_format: ``safetensors``, ``gguf``, ``dummy`` or ``auto`` (gguf for a ``.gguf`` path).
        hf_config: the ``transformers`` config.
        dtype: parameter and activation dtype.
        device: where the parameters are created.
        seed: seed of the ``dummy`` weights.

    Raises:
        ValueError: unsupported architecture or load format, unknown/missing/misshaped weights.
        FileNotFoundError: no weights where expected.
    """
    path = Path(model_path_or_file)
    if load_format == "auto":
        load_format = "gguf" if path.suffix == ".gguf" else "safetensors"
    if load_format not in ("safetensors", "gguf", "dummy"):
        raise ValueError(
            f"load_format={load_format!r} is invalid; allowed: auto, safetensors, gguf, dummy"
        )
    model_cls = resolve_model_class(hf_config)
    start = time.perf_counter()
    with torch.device(device):
        model = model_cls(hf_config, dtype)
    if load_format == "dummy":
        from fastdeploy.model_executor.model_loader.dummy_loader import load_dummy_weights

        load_dummy_weights(model, seed)
    else:
        total, weights = _weights(path, load_format, hf_config)
        progress = tqdm(weights, total=total, desc=f"Loading {load_format} weights", unit="tensor")
        model.load_weights(progress)
    logger.info(
        "loaded %s (%s weights, %s, %s) in %.1f s",
        model_cls.__name__,
        load_format,
        dtype,
        device,
        time.perf_counter() - start,
    )
    return model.eval()
