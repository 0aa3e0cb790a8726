"""The attention backend registry: valid names, errors that list them, platform defaults."""

from __future__ import annotations

import pytest

from fastdeploy.config import DeviceConfig
from fastdeploy.engine.args_utils import EngineArgs
from fastdeploy.model_executor.layers.attention.selector import (
    backend_names,
    get_attention_backend_cls,
    select_attention_backend,
)


def test_unknown_backend_lists_the_valid_ones():
    with pytest.raises(ValueError, match="valid: torch_native, flashinfer"):
        get_attention_backend_cls("flashattn")
    with pytest.raises(ValueError, match="flashattn.*valid: torch_native, flashinfer"):
        EngineArgs(attention_backend="flashattn").create_engine_config()
    with pytest.raises(ValueError, match="attention_backend=3 is invalid"):
        DeviceConfig(attention_backend=3)


def test_cpu_defaults_to_torch_native_and_refuses_flashinfer():
    assert select_attention_backend(None, "cpu").name == "torch_native"
    assert select_attention_backend("torch_native", "cpu").name == "torch_native"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        select_attention_backend("flashinfer", "cpu")
    assert set(backend_names()) == {"flashinfer", "torch_native"}
