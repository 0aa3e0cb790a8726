"""The shared decoder with mixture-of-experts layers (Qwen3-MoE, GLM-4-MoE, ERNIE-4.5-MoE).

The layers are :class:`~fastdeploy.model_executor.models.llama.DecoderLayer` with a
:class:`~fastdeploy.model_executor.layers.moe.SparseMoeBlock` as the MLP of the sparse layers, so
the forward is still ``embed -> pre_attention / attention / post_attention -> final_norm``: the
experts run inside ``post_attention``, hence inside the piecewise segments and the decode graphs.

An architecture subclass says which layers are sparse (:meth:`is_moe_layer`) and builds their
block (:meth:`make_moe_block`). This class adds the expert weights' Hugging Face names:

- ``mlp.gate.weight`` (router), ``mlp.gate.e_score_correction_bias``;
- ``mlp.experts.gate_up_proj`` / ``mlp.experts.down_proj`` (``transformers`` >= 5 in memory);
- ``mlp.experts.<j>.{gate,up,down}_proj.weight`` (checkpoints on disk);
- ``mlp.experts.{gate,up,down}_proj.weight`` (all experts stacked: GGUF's ``ffn_*_exps``);
- ``mlp.shared_experts.{gate,up,down}_proj.{weight,bias}``.

A stacked tensor counts as loaded once every element of it was copied, whichever form supplied
them (a tensor given twice would count twice; checkpoints hold each once).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Hashable, Iterable
from typing import Any

import torch
from torch import nn

from fastdeploy.model_executor.layers.linear import copy_weight
from fastdeploy.model_executor.layers.moe import SparseMoeBlock
from fastdeploy.model_executor.models.hf_weights import get_submodule, param_names
from fastdeploy.model_executor.models.llama import DecoderForCausalLM, DecoderMLP

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_PER_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
_STACKED = re.compile(r"mlp\.experts\.(gate|up|down)_proj\.weight")
_SHARED = re.compile(r"mlp\.shared_experts\.(gate|up|down)_proj\.(weight|bias)")
_MERGED_SHARD = {"gate": 0, "up": 1}


class MoEDecoderForCausalLM(DecoderForCausalLM):
    """A decoder whose sparse layers run a mixture of experts (the shared implementation).

    Raises:
        ValueError: as :class:`DecoderForCausalLM`, or a routing that does not fit the experts.
    """

    #: The experts are not split across ranks yet (the dense parts could be).
    supports_tensor_parallel = False

    #: ``mlp.<name>`` aliases of the router's correction bias inside a layer (ERNIE adds its own).
    BIAS_ALIASES: tuple[str, ...] = ("mlp.gate.e_score_correction_bias",)

    def is_moe_layer(self, hf_config: Any, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` is sparse; subclasses override."""
        raise NotImplementedError

    def make_moe_block(self, hf_config: Any, dtype: torch.dtype) -> SparseMoeBlock:
        """A sparse layer's block; subclasses override."""
        raise NotImplementedError

    def make_mlp(self, hf_config: Any, layer_idx: int, dtype: torch.dtype) -> nn.Module:
        if self.is_moe_layer(hf_config, layer_idx):
            return self.make_moe_block(hf_config, dtype)
        return super().make_mlp(hf_config, layer_idx, dtype)

    @staticmethod
    def make_shared_experts(
        hidden_size: int, intermediate_size: int, bias: bool, dtype: torch.dtype
    ) -> nn.Module | None:
        """The shared experts as one SwiGLU MLP of ``intermediate_size`` (None when 0)."""
        if intermediate_size <= 0:
            return None
        return DecoderMLP(hidden_size, intermediate_size, bias, dtype)

    def moe_blocks(self) -> list[SparseMoeBlock]:
        """The sparse blocks, in layer order."""
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, SparseMoeBlock)]

    # ---- weights ------------------------------------------------------------------------------

    def is_ignored_weight(self, hf_name: str) -> bool:
        """Checkpoint tensors the model does not use (e.g. multi-token-prediction layers)."""
        return hf_name.endswith("rotary_emb.inv_freq")

    def _resolve_moe(
        self, block: SparseMoeBlock, rest: str
    ) -> tuple[nn.Module, str, Hashable | None, str] | None:
        """``(module, param, shard, canonical name inside the layer)`` of an expert-block name."""
        if rest == "mlp.gate.weight":
            return block.gate, "weight", None, rest
        if rest in self.BIAS_ALIASES and block.gate.e_score_correction_bias is not None:
            canonical = self.BIAS_ALIASES[-1]
            return block.gate, "e_score_correction_bias", None, canonical
        if rest in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
            return block.experts, rest.rpartition(".")[2], None, rest
        if m := _PER_EXPERT.fullmatch(rest):
            part, expert = m.group(2), int(m.group(1))
            param = "down_proj" if part == "down" else "gate_up_proj"
            return block.experts, param, (part, expert), f"mlp.experts.{param}"
        if m := _STACKED.fullmatch(rest):
            part = m.group(1)
            if part == "down":
                return block.experts, "down_proj", None, "mlp.experts.down_proj"
            return block.experts, "gate_up_proj", (part, None), "mlp.experts.gate_up_proj"
        if (m := _SHARED.fullmatch(rest)) and block.shared_experts is not None:
            part, param = m.groups()
            shared = block.shared_experts
            if part == "down":
                return shared.down_proj, param, None, rest
            return shared.gate_up_proj, param, _MERGED_SHARD[part], rest
        return None

    def _resolve(self, hf_name: str) -> tuple[nn.Module, str, Hashable | None, str]:
        """``(module, param name, shard, canonical Hugging Face name)``.

        Raises:
            ValueError: an unknown name.
        """
        m = _LAYER.fullmatch(hf_name)
        if m and int(m.group(1)) < len(self.layers):
            mlp = self.layers[int(m.group(1))].mlp
            if isinstance(mlp, SparseMoeBlock):
                found = self._resolve_moe(mlp, m.group(2))
                if found is not None:
                    module, param, shard, canonical = found
                    if getattr(module, param, None) is None:
                        raise ValueError(f"unexpected checkpoint weight {hf_name!r}")
                    return module, param, shard, f"model.layers.{m.group(1)}.{canonical}"
        module, param, shard = super().locate_weight(hf_name)
        return module, param, shard, hf_name

    def locate_weight(self, hf_name: str) -> tuple[nn.Module, str, Hashable | None]:
        """Where the checkpoint tensor ``hf_name`` goes, expert forms included.

        Raises:
            ValueError: a name this model has no parameter for.
        """
        return self._resolve(hf_name)[:3]

    def hf_weight_names(self) -> list[str]:
        """Hugging Face names of every weight, experts in ``transformers`` >= 5's stacked form."""
        names = super().hf_weight_names()
        for i, layer in enumerate(self.layers):
            block = layer.mlp
            if not isinstance(block, SparseMoeBlock):
                continue
            prefix = f"model.layers.{i}"
            names.append(f"{prefix}.mlp.gate.weight")
            if block.gate.e_score_correction_bias is not None:
                names.append(f"{prefix}.{self.BIAS_ALIASES[-1]}")
            names += [f"{prefix}.mlp.experts.gate_up_proj", f"{prefix}.mlp.experts.down_proj"]
            if block.shared_experts is not None:
                for part, path in (("gate", "gate_up_proj"), ("up", "gate_up_proj")):
                    module = get_submodule(block.shared_experts, path)
                    names += param_names(f"{prefix}.mlp.shared_experts.{part}_proj", module)
                names += param_names(
                    f"{prefix}.mlp.shared_experts.down_proj", block.shared_experts.down_proj
                )
        return names

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True
    ) -> set[str]:
        """Copy checkpoint tensors given under Hugging Face names into the model.

        Takes every expert form listed in the module docstring; ignores what
        :meth:`is_ignored_weight` names and a tied ``lm_head.weight``.

        Returns:
            the canonical names (as :meth:`hf_weight_names`) that were loaded in full.

        Raises:
            ValueError: an unknown name, a shape mismatch, or (``strict``) a missing weight.
        """
        loaded: set[str] = set()
        elements: dict[str, int] = defaultdict(int)
        for hf_name, tensor in weights:
            if self.is_ignored_weight(hf_name):
                continue
            if hf_name == "lm_head.weight" and self.lm_head.tied:
                continue
            module, param_name, shard, canonical = self._resolve(hf_name)
            if hasattr(module, "load_weight"):
                module.load_weight(param_name, tensor, shard)
            else:
                copy_weight(getattr(module, param_name), tensor, hf_name)
            if canonical == hf_name:
                loaded.add(hf_name)
                continue
            # another form of a stacked weight: loaded once all of its elements were copied
            elements[canonical] += tensor.numel()
            if elements[canonical] >= getattr(module, param_name).numel():
                loaded.add(canonical)
        missing = [n for n in self.hf_weight_names() if n not in loaded]
        if strict and missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ValueError(f"checkpoint is missing {len(missing)} weight(s): {shown}")
        return loaded
