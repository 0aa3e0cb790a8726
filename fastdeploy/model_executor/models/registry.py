"""Model registry: Hugging Face architecture names -> our model classes, imported lazily."""

from __future__ import annotations

import importlib
from typing import Any

from torch import nn

# architecture -> (module under fastdeploy.model_executor.models, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "Glm4MoeForCausalLM": ("glm4_moe", "Glm4MoeForCausalLM"),
    "Ernie4_5ForCausalLM": ("ernie4_5", "Ernie4_5ForCausalLM"),
    "Ernie4_5_MoeForCausalLM": ("ernie4_5", "Ernie4_5_MoeForCausalLM"),
}
# Configs read from GGUF files carry no ``architectures``; their ``model_type`` decides.
_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "ernie4_5": "Ernie4_5ForCausalLM",
    "ernie4_5_moe": "Ernie4_5_MoeForCausalLM",
}


def supported_architectures() -> list[str]:
    """The architecture names we can serve, sorted."""
    return sorted(_MODELS)


def get_model_class(architecture: str) -> type[nn.Module]:
    """The model class of one Hugging Face architecture name.

    Raises:
        ValueError: an unknown architecture (the message lists the supported ones).
    """
    if architecture not in _MODELS:
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported: "
            f"{', '.join(supported_architectures())}"
        )
    module_name, class_name = _MODELS[architecture]
    module = importlib.import_module(f"fastdeploy.model_executor.models.{module_name}")
    return getattr(module, class_name)


def architecture_of(hf_config: Any) -> str:
    """The architecture name of a Hugging Face config: the first supported entry of
    ``architectures``, else the one implied by ``model_type``.

    Raises:
        ValueError: nothing supported (the message names the config's architectures and model type
            and lists the supported architectures).
    """
    architectures = list(getattr(hf_config, "architectures", None) or [])
    for arch in architectures:
        if arch in _MODELS:
            return arch
    model_type = getattr(hf_config, "model_type", None)
    if not architectures and model_type in _MODEL_TYPES:
        return _MODEL_TYPES[model_type]
    raise ValueError(
        f"model architectures={architectures} (model_type={model_type!r}) are not supported; "
        f"supported: {', '.join(supported_architectures())}"
    )


def resolve_model_class(hf_config: Any) -> type[nn.Module]:
    """The model class for a Hugging Face config (see :func:`architecture_of`)."""
    return get_model_class(architecture_of(hf_config))
