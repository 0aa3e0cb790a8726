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


def test_workspace_covers_tensor_core_decode_graphs():
    # Llama-3-8B (32/8 heads of 128) decodes on the tensor-core kernel; in a CUDA graph its plan
    # pads to ceil(B * 4 / 16) + B - 1 tiles of 16 query rows (flashinfer 0.5.3 PrefillPlan).
    for batch in (256, 512, 1024):
        tiles = -(-batch * 4 // 16) + batch - 1
        need = 32 * tiles * 16 * 128 * 4 + 32 * tiles * 16 * 4  # tmp_v + tmp_s
        assert float_workspace_bytes(32, 8, 128, 132, max_graph_decode_batch=batch) >= need
    # 512 requests (169 MB) no longer fit the 128 MiB that the CUDA-core path needed.
    assert float_workspace_bytes(32, 8, 128, 132, max_graph_decode_batch=512) > WORKSPACE_BYTES
    # The default 256 still fits it.
    assert float_workspace_bytes(32, 8, 128, 132, max_graph_decode_batch=256) == WORKSPACE_BYTES
    # Before Ampere flashinfer takes 64-row tiles: ceil(256 * 4 / 64) + 255 of them.
    assert (
        float_workspace_bytes(32, 8, 128, 132, max_graph_decode_batch=256, sm_major=7)
        >= 32 * (16 + 255) * 64 * 129 * 4
    )
