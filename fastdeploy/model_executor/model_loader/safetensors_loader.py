"""Reading Hugging Face safetensors checkpoints (one file or many shards) lazily."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open


def safetensors_files(directory: str | Path) -> list[Path]:
    """The checkpoint files of ``directory``, in order.

    With a ``*.safetensors.index.json`` only the shards it names are used (some repositories also
    ship a ``consolidated.safetensors`` in another naming); otherwise every ``*.safetensors``.

    Raises:
        FileNotFoundError: no safetensors file (the message names the directory).
    """
    directory = Path(directory)
    indexes = sorted(directory.glob("*.safetensors.index.json"))
    if indexes:
        weight_map = json.loads(indexes[0].read_text())["weight_map"]
        files = [directory / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {str(directory)!r}")
    return files


def count_safetensors(directory: str | Path) -> int:
    """Number of tensors in the checkpoint (reads only the headers)."""
    total = 0
    for path in safetensors_files(directory):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            total += len(list(f.keys()))
    return total


def iterate_safetensors(directory: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` one tensor at a time (CPU, the checkpoint's dtype), so no more
    than one tensor is in host memory beyond the model itself."""
    for path in safetensors_files(directory):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
