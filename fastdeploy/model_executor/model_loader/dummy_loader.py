"""Random weights for benchmarks and tests, and exporting any model's weights under HF names."""

from __future__ import annotations

import torch
from torch import nn

from fastdeploy.model_executor.layers.linear import MergedLinear, copy_weight
from fastdeploy.model_executor.layers.normalization import RMSNorm


@torch.no_grad()
def load_dummy_weights(
    model: nn.Module, seed: int = 0, std: float = 0.02, reference: nn.Module | None = None
) -> None:
    """Fill ``model`` in place: RMSNorm weights 1, every other parameter ``N(0, std**2)``.

    The values depend only on ``seed``, the model's parameter order and the device: they are
    drawn in float32 on the parameter's device (a generator per device, seeded with ``seed``),
    then cast to the parameter dtype. CPU and GPU draws differ; use :func:`export_hf_state_dict`
    to give the very same weights to another implementation.

    Args:
        model: the model to fill.
        seed, std: of the normal draws.
        reference: for a tensor-parallel shard, its unsharded twin (on the ``meta`` device is
            enough: only shapes are read). The full-size tensors are drawn in the twin's
            parameter order on ``model``'s device, exactly as one rank would, and each layer of
            ``model`` keeps its part, so every tensor-parallel size gets the same weights.
    """
    if reference is not None:
        _load_dummy_shards(model, reference, seed, std)
        return
    norm_weights = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    generators: dict[torch.device, torch.Generator] = {}
    for _, param in model.named_parameters():
        if id(param) in norm_weights:
            param.fill_(1.0)
            continue
        if param.device not in generators:
            generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
        values = torch.empty(param.shape, dtype=torch.float32, device=param.device)
        values.normal_(0.0, std, generator=generators[param.device])
        param.copy_(values)


def _load_dummy_shards(model: nn.Module, reference: nn.Module, seed: int, std: float) -> None:
    """See :func:`load_dummy_weights`: full draws in ``reference``'s order, loaded as shards."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    norms = {id(m.weight) for m in reference.modules() if isinstance(m, RMSNorm)}
    for name, full in reference.named_parameters():
        module_path, _, param_name = name.rpartition(".")
        ref_module, target = reference.get_submodule(module_path), model.get_submodule(module_path)
        if id(full) in norms:
            getattr(target, param_name).fill_(1.0)
            continue
        values = torch.empty(full.shape, dtype=torch.float32, device=device)
        values.normal_(0.0, std, generator=generator)
        if isinstance(ref_module, MergedLinear):  # one full tensor per shard (q/k/v, gate/up)
            for shard in ref_module.shard_ids:
                start, size = ref_module.shard_range(shard)
                target.load_weight(param_name, values.narrow(0, start, size), shard)
        elif hasattr(target, "load_weight"):
            target.load_weight(param_name, values)
        else:
            copy_weight(getattr(target, param_name), values, name)


def export_hf_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s weights under Hugging Face names (q/k/v and gate/up split back out), ready for
    ``transformers``' ``load_state_dict``. Tensors are views of the model's parameters.

    Raises:
        TypeError: the model cannot export (it has no ``hf_state_dict`` method).
    """
    export = getattr(model, "hf_state_dict", None)
    if export is None:
        raise TypeError(f"{type(model).__name__} cannot export Hugging Face weights")
    return export()
