"""Hugging Face weight names of the dense decoders: where each checkpoint tensor goes.

Functions over a model (no mixin):
:class:`~fastdeploy.model_executor.models.llama.DecoderForCausalLM` (and so every architecture
built on it) answers ``locate_weight``, ``hf_weight_names``, ``load_weights`` and
``hf_state_dict`` with them, over the tables below: q/k/v and gate/up checkpoint tensors go into
the merged projections (as shards of one parameter), everything else one to one. An architecture
with more names (the MoE decoders) overrides ``locate_weight`` and ``hf_weight_names``;
:func:`load_hf_weights` and :func:`export_hf_weights` go through the model's own.
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Iterable
from typing import Protocol

import torch
from torch import nn

from fastdeploy.model_executor.layers.linear import copy_weight

# Hugging Face module path inside ``model.layers.<i>`` -> (our module path inside a layer, shard).
LAYER_WEIGHTS: dict[str, tuple[str, Hashable | None]] = {
    "input_layernorm": ("input_layernorm", None),
    "self_attn.q_proj": ("qkv_proj", "q"),
    "self_attn.k_proj": ("qkv_proj", "k"),
    "self_attn.v_proj": ("qkv_proj", "v"),
    "self_attn.q_norm": ("q_norm", None),
    "self_attn.k_norm": ("k_norm", None),
    "self_attn.o_proj": ("o_proj", None),
    "post_attention_layernorm": ("post_attention_layernorm", None),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
    "mlp.down_proj": ("mlp.down_proj", None),
}
# Hugging Face module path -> our module path, outside the layers.
TOP_WEIGHTS = {"model.embed_tokens": "embed_tokens", "model.norm": "norm", "lm_head": "lm_head"}
_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)")


class HFNamedModel(Protocol):
    """What :func:`load_hf_weights` and :func:`export_hf_weights` ask of a model."""

    lm_head: nn.Module  # ``tied``: whether the head shares the embedding's weight

    def locate_weight(self, hf_name: str) -> tuple[nn.Module, str, Hashable | None]: ...

    def hf_weight_names(self) -> list[str]: ...


def locate_dense_weight(model: nn.Module, hf_name: str) -> tuple[nn.Module, str, Hashable | None]:
    """Where the checkpoint tensor ``hf_name`` goes in a dense decoder with ``embed_tokens``,
    ``layers``, ``norm`` and ``lm_head`` laid out as :data:`LAYER_WEIGHTS` /
    :data:`TOP_WEIGHTS` say: ``(module, parameter name, shard)`` (shard None: the whole
    parameter).

    Raises:
        ValueError: a name the model has no parameter for.
    """
    prefix, _, param_name = hf_name.rpartition(".")
    module, shard = None, None
    if prefix in TOP_WEIGHTS:
        module = getattr(model, TOP_WEIGHTS[prefix])
    elif (m := _LAYER_NAME.fullmatch(prefix)) and m.group(2) in LAYER_WEIGHTS:
        idx = int(m.group(1))
        if idx < len(model.layers):
            path, shard = LAYER_WEIGHTS[m.group(2)]
            module = get_submodule(model.layers[idx], path)
    if module is None or getattr(module, param_name, None) is None:
        raise ValueError(f"unexpected checkpoint weight {hf_name!r} for {type(model).__name__}")
    return module, param_name, shard


def dense_weight_names(model: nn.Module) -> list[str]:
    """The Hugging Face names a checkpoint of a dense decoder must provide (tied head
    excluded)."""
    names = []
    for hf_prefix, path in TOP_WEIGHTS.items():
        if path == "lm_head" and model.lm_head.tied:
            continue
        names += param_names(hf_prefix, getattr(model, path))
    for i, layer in enumerate(model.layers):
        for hf_path, (path, _) in LAYER_WEIGHTS.items():
            module = get_submodule(layer, path)
            if module is not None:
                names += param_names(f"model.layers.{i}.{hf_path}", module)
    return names


def load_hf_weights(
    model: HFNamedModel, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True
) -> set[str]:
    """Copy checkpoint tensors given under Hugging Face names into ``model`` (placed by its
    ``locate_weight``).

    q/k/v and gate/up go into their merged projections; rotary ``inv_freq`` buffers are
    ignored; ``lm_head.weight`` is ignored when the head is tied to the embedding.

    Returns:
        the Hugging Face names that were loaded.

    Raises:
        ValueError: an unknown name, a shape mismatch, or (``strict``) a missing weight.
    """
    loaded = set()
    for hf_name, tensor in weights:
        if hf_name.endswith("rotary_emb.inv_freq"):
            continue
        if hf_name == "lm_head.weight" and model.lm_head.tied:
            continue
        module, param_name, shard = model.locate_weight(hf_name)
        if hasattr(module, "load_weight"):
            module.load_weight(param_name, tensor, shard)
        else:
            copy_weight(getattr(module, param_name), tensor, hf_name)
        loaded.add(hf_name)
    missing = [n for n in model.hf_weight_names() if n not in loaded]
    if strict and missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ValueError(f"checkpoint is missing {len(missing)} weight(s): {shown}")
    return loaded


def export_hf_weights(model: HFNamedModel) -> dict[str, torch.Tensor]:
    """All of ``model``'s weights under Hugging Face names (views sharing memory with the
    model), so that ``transformers``' model of the same config can ``load_state_dict`` them. A
    tied head is included as ``lm_head.weight`` too."""
    out = {}
    tied = ["lm_head.weight"] if model.lm_head.tied else []
    for hf_name in model.hf_weight_names() + tied:
        module, param_name, shard = model.locate_weight(hf_name)
        if hasattr(module, "export_weight"):
            out[hf_name] = module.export_weight(param_name, shard)
        else:
            out[hf_name] = getattr(module, param_name).detach()
    return out


def get_submodule(module: nn.Module, path: str) -> nn.Module | None:
    """The submodule at dotted ``path`` inside ``module``, or None where a part is missing."""
    for part in path.split("."):
        module = getattr(module, part, None)
        if module is None:
            return None
    return module


def param_names(prefix: str, module: nn.Module) -> list[str]:
    """``prefix.<name>`` of each of ``module``'s own parameters."""
    return [f"{prefix}.{name}" for name, _ in module.named_parameters(recurse=False)]
