"""Functions the TP tests run in spawned rank processes (module level, so they pickle)."""

from __future__ import annotations

import os
import sys
import time


def collective_rank(rank: int, world: int, addr: str, out_dir: str) -> None:
    """Join the group, all-reduce, all-gather and receive rank 0's step; write what it saw."""
    import torch

    from fastdeploy.distributed.parallel_state import (
        all_gather_last_dim,
        all_reduce,
        broadcast_step,
        destroy_tp_group,
        init_tp_group,
    )

    tp = init_tp_group(rank, world, addr, "cpu", timeout_s=60)
    try:
        summed = all_reduce(torch.full((3,), float(rank + 1)), tp).tolist()
        gathered = all_gather_last_dim(torch.full((2, 1), float(rank)), tp)[0].tolist()
        step = broadcast_step({"step": 7, "from": rank} if rank == 0 else None, tp)
        with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
            f.write(repr((summed, gathered, step)))
    finally:
        destroy_tp_group()


def die_rank(rank: int, code: int) -> None:
    """Exit with ``code`` after a moment (a rank that crashes)."""
    time.sleep(0.2)
    sys.exit(code)


def stubborn_rank(rank: int) -> None:
    """Ignore SIGTERM (stop() must kill it)."""
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(600)


def layers_rank(rank: int, world: int, addr: str, out_dir: str) -> None:
    """Build each TP layer and its unsharded twin from the same full weights; write the largest
    difference of their outputs."""
    import torch
    import torch.nn.functional as F

    from fastdeploy.distributed.parallel_state import destroy_tp_group, init_tp_group
    from fastdeploy.model_executor.layers.embeddings import LMHead, VocabEmbedding
    from fastdeploy.model_executor.layers.linear import Linear, MergedLinear, QKVLinear
    from fastdeploy.model_executor.layers.parallel_linear import (
        MergedColumnParallelLinear,
        ParallelLMHead,
        QKVParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
    )

    tp = init_tp_group(rank, world, addr, "cpu", timeout_s=60)
    try:
        g = torch.Generator().manual_seed(0)
        hidden, inter, vocab, head_dim, heads, kv_heads = 16, 24, 37, 4, 4, 2
        x = torch.randn(5, hidden, generator=g)
        w_gate, w_up = (
            torch.randn(inter, hidden, generator=g),
            torch.randn(inter, hidden, generator=g),
        )
        w_down, b_down = torch.randn(hidden, inter, generator=g), torch.randn(hidden, generator=g)
        w_q = torch.randn(heads * head_dim, hidden, generator=g)
        w_k = torch.randn(kv_heads * head_dim, hidden, generator=g)
        w_v = torch.randn(kv_heads * head_dim, hidden, generator=g)
        emb = torch.randn(vocab, hidden, generator=g)
        ids = torch.tensor([0, 5, 18, 19, 36])
        diffs = {}

        full_gu = MergedLinear(hidden, [inter, inter], [0, 1])
        full_down = Linear(inter, hidden, bias=True)
        tp_gu = MergedColumnParallelLinear(hidden, [inter, inter], [0, 1], tp=tp)
        tp_down = RowParallelLinear(inter, hidden, bias=True, tp=tp)
        for layer in (full_gu, tp_gu):
            layer.load_weight("weight", w_gate, 0)
            layer.load_weight("weight", w_up, 1)
        for layer in (full_down, tp_down):
            layer.load_weight("weight", w_down)
            layer.load_weight("bias", b_down)

        def mlp(gu, down):
            gate, up = gu.split(gu(x))
            return down(F.silu(gate) * up)

        diffs["mlp"] = (mlp(full_gu, full_down) - mlp(tp_gu, tp_down)).abs().max().item()

        full_qkv, tp_qkv = (
            QKVLinear(hidden, head_dim, heads, kv_heads),
            QKVParallelLinear(hidden, head_dim, heads, kv_heads, tp=tp),
        )
        for layer in (full_qkv, tp_qkv):
            for sid, w in (("q", w_q), ("k", w_k), ("v", w_v)):
                layer.load_weight("weight", w, sid)
        fq, fk, fv = full_qkv.split(full_qkv(x))
        q, k, v = tp_qkv.split(tp_qkv(x))
        nq, nkv = heads // world * head_dim, kv_heads // world * head_dim
        diffs["qkv"] = max(
            (fq[:, rank * nq : (rank + 1) * nq] - q).abs().max().item(),
            (fk[:, rank * nkv : (rank + 1) * nkv] - k).abs().max().item(),
            (fv[:, rank * nkv : (rank + 1) * nkv] - v).abs().max().item(),
        )
        full_emb, tp_emb = (
            VocabEmbedding(vocab, hidden),
            VocabParallelEmbedding(vocab, hidden, tp=tp),
        )
        with torch.no_grad():
            full_emb.weight.copy_(emb)
        tp_emb.load_full(emb)
        diffs["embedding"] = (full_emb(ids) - tp_emb(ids)).abs().max().item()
        full_head, tp_head = LMHead(vocab, hidden), ParallelLMHead(vocab, hidden, tp=tp)
        with torch.no_grad():
            full_head.weight.copy_(emb)
        tp_head.load_full(emb)
        logits = tp_head(x)
        diffs["lm_head"] = (full_head(x) - logits).abs().max().item()
        diffs["lm_head_shape"] = list(logits.shape)
        try:
            QKVParallelLinear(hidden, head_dim, 4, 3, tp=tp)
        except ValueError as e:
            diffs["error"] = str(e)
        with open(os.path.join(out_dir, f"layers{rank}.txt"), "w") as f:
            f.write(repr(diffs))
    finally:
        destroy_tp_group()
