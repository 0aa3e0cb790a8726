"""Random weights for benchmarks and tests, and exporting any model's weights under HF names."""

from __future__ import annotations

import torch
from torch import nn

from fastdeploy.model_executor.layers.normalization import RMSNorm


@torch.no_grad()
def load_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Fill ``model`` in place: RMSNorm weights 1, every other parameter ``N(0, std**2)``.

    The values depend only on ``seed``, the model's parameter order and the device: they are
    drawn in float32 on the parameter's device (a generator per device, seeded with ``seed``),
    then cast to the parameter dtype. CPU and GPU draws differ; use :func:`export_hf_state_dict`
    to give the very same weights to another implementation.
    """
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
