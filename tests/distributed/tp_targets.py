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
        # longer than one header broadcast (STEP_HEADER_BYTES): a second collective carries the rest
        big = broadcast_step(list(range(rank, rank + 20000)) if rank == 0 else None, tp)
        empty = broadcast_step(None, tp)
        with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
            f.write(repr((summed, gathered, step, big == list(range(20000)), empty)))
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


def model_rank(rank: int, world: int, addr: str, out_dir: str, name: str) -> None:
    """A tiny model at TP=``world`` loaded from the full model's checkpoint tensors: write the
    largest logit difference to the full model and both models' greedy tokens."""
    import torch
    import transformers

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from paged_runner import PagedRunner

    from fastdeploy.distributed.parallel_state import destroy_tp_group, init_tp_group
    from fastdeploy.model_executor.models.registry import resolve_model_class

    common = dict(
        vocab_size=250, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-6,
    )  # fmt: skip
    if name == "qwen3":
        cfg = transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=False)
    else:
        cfg = transformers.LlamaConfig(**common, tie_word_embeddings=True, mlp_bias=True)
    tp = init_tp_group(rank, world, addr, "cpu", timeout_s=60)
    try:
        cls = resolve_model_class(cfg)
        full = cls(cfg, torch.float32).eval()
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for pname, p in full.named_parameters():
                noise = torch.randn(p.shape, generator=g)
                p.copy_(1 + 0.2 * noise if "norm" in pname else noise * 0.3)
        sharded = cls(cfg, torch.float32, tp=tp).eval()
        sharded.load_weights(full.hf_state_dict().items())
        prompt = [int(t) for t in torch.randint(3, 250, (23,), generator=g)]
        with torch.inference_mode():
            ref_last, ref_all = PagedRunner(full).step([("a", prompt)])
            got_last, got_all = PagedRunner(sharded).step([("a", prompt)])
            tokens = {
                "full": PagedRunner(full).generate_greedy("b", prompt, 8, set())[0],
                "tp": PagedRunner(sharded).generate_greedy("b", prompt, 8, set())[0],
            }
        result = {
            "diff": (ref_all - got_all).abs().max().item(),
            "heads": (sharded.layers[0].num_heads, sharded.layers[0].num_kv_heads),
            **tokens,
        }
        with open(os.path.join(out_dir, f"model{rank}.txt"), "w") as f:
            f.write(repr(result))
    finally:
        destroy_tp_group()


def loader_rank(rank: int, world: int, addr: str, out_dir: str, sources: dict) -> None:
    """For each ``name -> (path, load_format)``: the model loaded whole and loaded as this
    rank's shard by ``get_model``; write the largest logit difference and both greedy tokens."""
    import torch

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from paged_runner import PagedRunner

    from fastdeploy.distributed.parallel_state import destroy_tp_group, init_tp_group
    from fastdeploy.model_executor.model_loader import get_model
    from fastdeploy.model_executor.model_loader.source import resolve_model

    torch.set_num_threads(1)
    tp = init_tp_group(rank, world, addr, "cpu", timeout_s=60)
    try:
        results = {}
        prompt = list(range(3, 40))
        for name, (path, load_format) in sources.items():
            source = resolve_model(path, load_format)
            full = get_model(source, torch.float32, "cpu", 7)
            shard = get_model(source, torch.float32, "cpu", 7, tp=tp)
            with torch.inference_mode():
                _, ref = PagedRunner(full).step([("a", prompt)])
                _, got = PagedRunner(shard).step([("a", prompt)])
                results[name] = {
                    "diff": (ref - got).abs().max().item(),
                    "kv_heads": shard.layers[0].num_kv_heads,
                    "full": PagedRunner(full).generate_greedy("b", prompt, 6, set())[0],
                    "tp": PagedRunner(shard).generate_greedy("b", prompt, 6, set())[0],
                }
        with open(os.path.join(out_dir, f"loader{rank}.txt"), "w") as f:
            f.write(repr(results))
    finally:
        destroy_tp_group()


def node_main(node_rank: int, model: str, engine_kwargs: dict) -> None:
    """Node ``node_rank`` of a multi-node deployment on this host: its ranks join rank 0."""
    from fastdeploy.engine.args_utils import EngineArgs
    from fastdeploy.worker.executor import run_node

    config = EngineArgs.from_kwargs(
        model=model, node_rank=node_rank, **engine_kwargs
    ).create_engine_config()
    run_node(config)


def fake_fused_allreduce(
    *, allreduce_in, residual_in, residual_out, norm_out, rms_gamma, rms_eps, pattern_code, **_
) -> None:
    """A stand-in for flashinfer's ``trtllm_allreduce_fusion`` (pattern kARResidualRMSNorm) on
    CPU: the same outputs from gloo all-reduce + residual add + float32 RMSNorm."""
    import torch
    import torch.distributed as dist

    assert pattern_code == 1
    summed = allreduce_in.clone()
    dist.all_reduce(summed)
    total = summed + residual_in
    residual_out.copy_(total)
    h = total.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + rms_eps)
    norm_out.copy_(rms_gamma * h.to(total.dtype))


def fusion_rank(rank: int, world: int, addr: str, out_dir: str) -> None:
    """A tiny Llama with attention and MLP biases at TP=``world``, unfused and with the fused
    all-reduce (a CPU stand-in op, workspace for 8 tokens): logits of a 5-token step (fused path)
    and a 23-token step (the fallback) against the full model, and how often each path ran."""
    import dataclasses

    import torch
    import transformers

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from paged_runner import PagedRunner

    from fastdeploy.distributed.parallel_state import destroy_tp_group, init_tp_group
    from fastdeploy.model_executor.layers.allreduce_fusion import AllReduceFusion
    from fastdeploy.model_executor.models.registry import resolve_model_class

    cfg = transformers.LlamaConfig(
        vocab_size=250, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-6, attention_bias=True, mlp_bias=True, tie_word_embeddings=False,
    )  # fmt: skip
    tp = init_tp_group(rank, world, addr, "cpu", timeout_s=60)
    try:
        fusion = AllReduceFusion(tp, 8, cfg.hidden_size, op=fake_fused_allreduce)
        cls = resolve_model_class(cfg)
        full = cls(cfg, torch.float32).eval()
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in full.named_parameters():
                noise = torch.randn(p.shape, generator=g)
                p.copy_(1 + 0.2 * noise if "norm" in name else 0.3 * noise)
        weights = full.hf_state_dict()
        plain = cls(cfg, torch.float32, tp=tp).eval()
        plain.load_weights(weights.items())
        fused = cls(cfg, torch.float32, tp=dataclasses.replace(tp, allreduce_fusion=fusion)).eval()
        fused.load_weights(weights.items())
        result = {"reduce": [fused.layers[0].o_proj.reduce, fused.layers[0].mlp.reduce]}
        with torch.inference_mode():
            for n in (5, 23):
                prompt = [int(t) for t in torch.randint(3, 250, (n,), generator=g)]
                _, ref = PagedRunner(full).step([("a", prompt)])
                _, unfused = PagedRunner(plain).step([("a", prompt)])
                before = (fusion.num_fused, fusion.num_fallback)
                _, got = PagedRunner(fused).step([("a", prompt)])
                result[n] = {
                    "diff": (ref - got).abs().max().item(),
                    "diff_unfused": (ref - unfused).abs().max().item(),
                    "fused": fusion.num_fused - before[0],
                    "fallback": fusion.num_fallback - before[1],
                }
            result["greedy"] = [
                PagedRunner(m).generate_greedy("b", list(range(3, 30)), 6, set())[0]
                for m in (full, fused)
            ]
        with open(os.path.join(out_dir, f"fusion{rank}.txt"), "w") as f:
            f.write(repr(result))
    finally:
        destroy_tp_group()
