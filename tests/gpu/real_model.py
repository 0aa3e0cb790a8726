"""The real default model for GPU tests: a paged runner that stores K/V the way the engine does
(in the RoPE kernel). Where its GGUF is: the ``real_gguf`` fixture of ``conftest.py``.
"""

from __future__ import annotations

import torch
from paged_runner import PagedRunner

from fastdeploy.model_executor.forward_meta import ForwardMeta


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
