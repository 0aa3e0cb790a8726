"""Test helper: run a model step by step through the torch-native backend and a paged KV cache,
the way the model runner does, but with plain Python bookkeeping."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from fastdeploy.model_executor.forward_meta import ForwardMeta
from fastdeploy.model_executor.layers.attention.backend import AttentionBatch
from fastdeploy.model_executor.layers.attention.torch_native import TorchNativeAttentionBackend


@dataclass
class _Seq:
    num_computed: int = 0
    block_ids: list[int] = field(default_factory=list)


class PagedRunner:
    """Holds the KV caches and the block tables of a few sequences.

    Blocks are handed out in a shuffled order (``block_seed``), so block tables are not the
    identity and a wrong gather shows up.
    """

    def __init__(self, model, block_size: int = 16, num_blocks: int = 64, block_seed: int = 0):
        cfg = model.config
        self.model = model
        self.block_size = block_size
        self.device = model.embed_tokens.weight.device
        self.dtype = model.embed_tokens.weight.dtype
        layer = model.layers[0]
        self.backend = TorchNativeAttentionBackend(
            layer.num_heads, layer.num_kv_heads, layer.head_dim, block_size, self.dtype, self.device
        )
        shape = self.backend.kv_cache_shape(num_blocks)
        self.kv_caches = [
            torch.zeros(shape, dtype=self.dtype, device=self.device)
            for _ in range(cfg.num_hidden_layers)
        ]
        self.free_blocks = list(range(num_blocks))
        random.Random(block_seed).shuffle(self.free_blocks)
        self.seqs: dict[str, _Seq] = {}

    def build_batch(self, chunks: list[tuple[str, list[int]]], pad_to: int | None = None):
        """AttentionBatch, input ids and positions for one step; allocates blocks."""
        ids, positions, slots, qsl, seq_lens, qlens = [], [], [], [0], [], []
        for rid, new in chunks:
            seq = self.seqs.setdefault(rid, _Seq())
            start, end = seq.num_computed, seq.num_computed + len(new)
            while len(seq.block_ids) * self.block_size < end:
                seq.block_ids.append(self.free_blocks.pop())
            for pos in range(start, end):
                block = seq.block_ids[pos // self.block_size]
                slots.append(block * self.block_size + pos % self.block_size)
            ids += new
            positions += range(start, end)
            qsl.append(qsl[-1] + len(new))
            seq_lens.append(end)
            qlens.append(len(new))
            seq.num_computed = end
        num_tokens = len(ids)
        pad = (pad_to or num_tokens) - num_tokens
        ids, positions, slots = ids + [0] * pad, positions + [0] * pad, slots + [-1] * pad
        max_blocks = max(len(self.seqs[rid].block_ids) for rid, _ in chunks)
        tables = torch.zeros(len(chunks), max_blocks, dtype=torch.int32)
        for i, (rid, _) in enumerate(chunks):
            blocks = self.seqs[rid].block_ids
            tables[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        dev = self.device
        batch = AttentionBatch(
            num_reqs=len(chunks),
            num_tokens=num_tokens,
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=tables.to(dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            max_query_len=max(qlens),
            max_seq_len=max(seq_lens),
            is_decode_only=all(q == 1 for q in qlens),
            query_lens_host=qlens,
            seq_lens_host=seq_lens,
        )
        return (
            batch,
            torch.tensor(ids, dtype=torch.int64, device=dev),
            torch.tensor(positions, dtype=torch.int64, device=dev),
        )

    @torch.inference_mode()
    def step(self, chunks: list[tuple[str, list[int]]], pad_to: int | None = None):
        """Run one step; returns float32 logits ``[len(chunks), vocab]`` of each chunk's last
        token and, for checks, float32 logits of all real tokens ``[num_tokens, vocab]``."""
        batch, input_ids, positions = self.build_batch(chunks, pad_to)
        meta = ForwardMeta(
            attn_backend=self.backend,
            attn_metadata=self.backend.build_metadata(batch),
            kv_caches=self.kv_caches,
        )
        hidden = self.model(input_ids, positions, meta)[: batch.num_tokens]
        last = batch.query_start_loc[1:].long() - 1
        return self.model.compute_logits(hidden[last]), self.model.compute_logits(hidden)

    def generate_greedy(
        self, rid: str, prompt: list[int], max_new_tokens: int, eos_ids: set[int]
    ) -> tuple[list[int], torch.Tensor]:
        """Prefill ``prompt`` in one step, then decode one token per step (argmax).

        Returns:
            the new tokens (up to and including an eos) and the float32 logits that chose each,
            ``[len(tokens), vocab]``.
        """
        tokens: list[int] = []
        logits: list[torch.Tensor] = []
        new = list(prompt)
        for _ in range(max_new_tokens):
            last, _ = self.step([(rid, new)])
            logits.append(last[0])
            tokens.append(int(last[0].argmax()))
            if tokens[-1] in eos_ids:
                break
            new = [tokens[-1]]
        return tokens, torch.stack(logits)
