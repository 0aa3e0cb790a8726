"""Building a model and filling its weights: :func:`get_model`."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from fastdeploy.distributed.parallel_state import TPGroup
from fastdeploy.model_executor.layers.parallel_linear import divide
from fastdeploy.model_executor.model_loader.source import ModelSource
from fastdeploy.model_executor.models.registry import architecture_of, resolve_model_class

logger = logging.getLogger(__name__)

__all__ = ["ModelSource", "check_tensor_parallel", "get_model", "load_model"]


def check_tensor_parallel(hf_config: Any, world_size: int) -> tuple[int, int]:
    """Whether the model of ``hf_config`` can be split over ``world_size`` ranks; checked before
    any rank starts.

    Returns:
        ``(query heads, KV heads)`` of one rank.

    Raises:
        ValueError: an architecture whose split is not implemented (the MoE decoders), or a head
            count or intermediate size that does not divide by ``world_size`` (names the numbers;
            never a silent replication).
    """
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    if world_size == 1:
        return heads, kv_heads
    if not resolve_model_class(hf_config).supports_tensor_parallel:
        raise ValueError(
            f"tensor_parallel_size={world_size} is not supported for {architecture_of(hf_config)} "
            f"yet (its experts are not split); allowed: 1"
        )
    divide(hf_config.intermediate_size, world_size, "intermediate_size")
    return (
        divide(heads, world_size, "num_attention_heads"),
        divide(kv_heads, world_size, "num_key_value_heads"),
    )


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

    - ``get_model(source: ModelSource, dtype, device, seed=0, tp=None)``, the resolved model from
      :func:`~fastdeploy.model_executor.model_loader.source.resolve_model`;
    - ``get_model(model_path_or_file, load_format, hf_config, dtype, device, seed=0, tp=None)``,
      see :func:`load_model`.
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
    tp: TPGroup | None = None,
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
        tp: this rank's tensor-parallel group (None: the whole model). The rank's model holds its
            shard only: safetensors and GGUF tensors are read one at a time and each layer keeps
            its rows or columns; ``dummy`` weights are drawn at full size, as one rank would, and
            split the same way, so every tensor-parallel size gives the same model.

    Raises:
        ValueError: unsupported architecture or load format, unknown/missing/misshaped weights,
            or a model that cannot be split over ``tp`` (see :func:`check_tensor_parallel`).
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
    sharded = tp is not None and tp.world_size > 1
    if sharded:
        check_tensor_parallel(hf_config, tp.world_size)
    start = time.perf_counter()
    with torch.device(device):
        model = model_cls(hf_config, dtype, tp=tp) if sharded else model_cls(hf_config, dtype)
    if load_format == "dummy":
        from fastdeploy.model_executor.model_loader.dummy_loader import load_dummy_weights

        reference = None
        if sharded:  # the unsharded twin, shapes only: what one rank would draw
            with torch.device("meta"):
                reference = model_cls(hf_config, dtype)
        load_dummy_weights(model, seed, reference=reference)
    else:
        total, weights = _weights(path, load_format, hf_config)
        progress = tqdm(weights, total=total, desc=f"Loading {load_format} weights", unit="tensor")
        model.load_weights(progress)
    logger.info(
        "loaded %s (%s weights, %s, %s%s) in %.1f s",
        model_cls.__name__,
        load_format,
        dtype,
        device,
        f", tensor-parallel rank {tp.rank} of {tp.world_size}" if sharded else "",
        time.perf_counter() - start,
    )
    return model.eval()
