"""The flashinfer float workspace covers the largest split-KV prefill plan (pure arithmetic; the
formula is flashinfer 0.5.3's PrefillPlan)."""

from __future__ import annotations

from fastdeploy.model_executor.layers.attention.flashinfer_backend import (
    WORKSPACE_BYTES,
    float_workspace_bytes,
)


def test_workspace_covers_the_split_kv_prefill_bound():
    # Qwen3-30B-A3B attention on an H200 (132 SMs): tmp_v alone is 32 * 66 * 128 * 128 * 4 B.
    need = 32 * (2 * 132 // 4) * 128 * 128 * 4
    assert need > WORKSPACE_BYTES  # what overflowed at 8,192 tokens with 128 MiB
    assert float_workspace_bytes(32, 4, 128, 132) >= need + 32 * 66 * 128 * 4
    # SmolLM2-135M and Llama-3-8B fit flashinfer's suggested 128 MiB.
    assert float_workspace_bytes(9, 3, 64, 132) == WORKSPACE_BYTES
    assert float_workspace_bytes(32, 8, 128, 132) == WORKSPACE_BYTES
