"""Which flashinfer decode kernel a model's attention shape gets (no GPU needed): the rule, and
``FD_FLASHINFER_USE_TENSOR_CORES`` overriding it."""

import pytest

from fastdeploy.model_executor.layers.attention.flashinfer_backend import decode_uses_tensor_cores


@pytest.mark.parametrize(
    "heads,kv_heads,want",
    [
        (9, 3, False),  # SmolLM2-135M: group 3, CUDA-core decode kernel
        (32, 32, False),  # MHA
        (32, 8, True),  # Llama-3-8B: group 4
        (64, 8, True),  # group 8
        (28, 4, True),  # group 7: no CUDA-core kernel for it
        (40, 8, True),  # group 5
    ],
)
def test_rule(monkeypatch, heads: int, kv_heads: int, want: bool):
    monkeypatch.delenv("FD_FLASHINFER_USE_TENSOR_CORES", raising=False)
    assert decode_uses_tensor_cores(heads, kv_heads) is want


def test_override(monkeypatch):
    monkeypatch.setenv("FD_FLASHINFER_USE_TENSOR_CORES", "1")
    assert decode_uses_tensor_cores(9, 3) is True
    monkeypatch.setenv("FD_FLASHINFER_USE_TENSOR_CORES", "0")
    assert decode_uses_tensor_cores(32, 8) is False
    with pytest.raises(ValueError, match="no GQA group of 7 query heads per KV head"):
        decode_uses_tensor_cores(28, 4)
    monkeypatch.setenv("FD_FLASHINFER_USE_TENSOR_CORES", "sometimes")
    with pytest.raises(ValueError, match="FD_FLASHINFER_USE_TENSOR_CORES='sometimes'"):
        decode_uses_tensor_cores(32, 8)
