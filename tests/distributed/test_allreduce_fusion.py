"""The fused all-reduce + residual add + RMSNorm, on CPU: the policy's rule 9 (on or off, and
why; the workspace holds every step the default ladders can produce), and the decoder's plumbing
with a stand-in fused op over gloo (fused path, fallback above the workspace, biases)."""

from __future__ import annotations

import ast
import importlib.util

import pytest
from test_tp_processes import run_two_ranks
from tp_targets import fusion_rank

from fastdeploy.config import (
    DeploymentPlan,
    DeviceConfig,
    FDConfig,
    GraphOptimizationConfig,
    ParallelConfig,
    SchedulerConfig,
)
from fastdeploy.config.resolve import plan_deployment
from fastdeploy.model_executor.layers import allreduce_fusion
from fastdeploy.platforms import get_platform


def make_config(
    *,
    tp: int = 2,
    fusion: bool = True,
    platform: str = "cuda",
    nnodes: int = 1,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 512,
    **graph: object,
) -> FDConfig:
    return FDConfig(
        device_config=DeviceConfig(
            device=platform, attention_backend=get_platform(platform).default_attention_backend
        ),
        parallel_config=ParallelConfig(
            tensor_parallel_size=tp, enable_flashinfer_allreduce_fusion=fusion, nnodes=nnodes
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens
        ),
        graph_opt_config=GraphOptimizationConfig(**graph),
    )


@pytest.fixture
def flashinfer_present(monkeypatch):
    """The policy sees flashinfer's comm module as importable (this host has no GPU)."""
    monkeypatch.setattr(allreduce_fusion, "fusion_unavailable", lambda: None)


def fusion_reasons(plan: DeploymentPlan) -> list[str]:
    return [r for r in plan.reasons if r.startswith("allreduce fusion")]


def test_one_rank_says_nothing_unless_asked():
    plan = plan_deployment(make_config(tp=1, fusion=False))
    assert not plan.allreduce_fusion and fusion_reasons(plan) == []
    plan = plan_deployment(make_config(tp=1))
    assert not plan.allreduce_fusion and plan.allreduce_fusion_max_tokens == 0
    assert fusion_reasons(plan) == [
        "allreduce fusion off: tensor_parallel_size=1 has no all-reduce"
    ]


def test_off_without_the_flag(flashinfer_present):
    plan = plan_deployment(make_config(fusion=False))
    assert not plan.allreduce_fusion
    assert "enable_flashinfer_allreduce_fusion=false" in fusion_reasons(plan)[0]


def test_off_on_cpu(flashinfer_present):
    plan = plan_deployment(make_config(platform="cpu"))
    assert not plan.allreduce_fusion
    assert fusion_reasons(plan) == [
        "allreduce fusion off: platform 'cpu': flashinfer's fused all-reduce needs CUDA"
    ]


def test_off_without_flashinfer(monkeypatch):
    monkeypatch.setattr(
        allreduce_fusion, "fusion_unavailable", lambda: "flashinfer is not installed"
    )
    plan = plan_deployment(make_config())
    assert not plan.allreduce_fusion
    assert fusion_reasons(plan) == ["allreduce fusion off: flashinfer is not installed"]


@pytest.mark.skipif(importlib.util.find_spec("flashinfer") is not None, reason="flashinfer here")
def test_the_real_check_reports_flashinfer_missing():
    assert allreduce_fusion.fusion_unavailable() == "flashinfer is not installed"
    plan = plan_deployment(make_config())
    assert fusion_reasons(plan) == ["allreduce fusion off: flashinfer is not installed"]


def test_off_across_hosts_and_for_unsupported_group_sizes(flashinfer_present):
    plan = plan_deployment(make_config(nnodes=2))
    assert not plan.allreduce_fusion and "nnodes=2" in fusion_reasons(plan)[0]
    assert "CUDA IPC" in fusion_reasons(plan)[0]
    plan = plan_deployment(make_config(tp=3, max_num_seqs=48, max_num_batched_tokens=384))
    assert not plan.allreduce_fusion
    assert "tensor_parallel_size=3; flashinfer fuses for 2, 4, 8 ranks" in fusion_reasons(plan)[0]


def test_on_sized_for_the_largest_step_and_round_trips(flashinfer_present):
    plan = plan_deployment(make_config(max_num_batched_tokens=2048))
    assert plan.allreduce_fusion and plan.allreduce_fusion_max_tokens == 2048
    [reason] = fusion_reasons(plan)
    assert reason.startswith("allreduce fusion on: flashinfer trtllm_allreduce_fusion")
    assert "workspace for 2048 tokens" in reason and "largest prefill bucket 2048" in reason
    assert DeploymentPlan.from_dict(plan.to_dict()) == plan
    assert plan.to_dict()["allreduce_fusion_max_tokens"] == 2048  # what --print-config shows
    # Without prefill graphs the largest step is the token budget.
    plan = plan_deployment(make_config(max_num_batched_tokens=1024, full_cuda_graph=True))
    assert plan.allreduce_fusion and plan.allreduce_fusion_max_tokens == 1024


def test_workspace_bytes_follow_flashinfer_sizing():
    # 2 ranks x 8192 tokens x 4096 (Llama-3-8B): 128 MiB data + 2 MiB flags + 3 x 128 MiB Lamport
    assert allreduce_fusion.workspace_bytes(2, 8192, 4096) == (128 + 2 + 384) << 20
    assert allreduce_fusion.workspace_bytes(2, 8192, 4096, elem=4) == (128 + 2 + 768) << 20


@pytest.mark.parametrize(
    "seqs, budget, graph",
    [
        (256, 8192, {}),
        (64, 2048, {}),
        (256, 512, {}),
        (16, 16, {}),
        (128, 3000, {"max_capture_shape_prefill": 1024}),
        (64, 2048, {"full_cuda_graph": True}),
        (64, 2048, {"use_cudagraph": False}),
        (32, 4096, {"cudagraph_only_prefill": True}),
    ],
)
def test_no_step_of_the_default_ladders_exceeds_the_workspace(
    flashinfer_present, seqs, budget, graph
):
    """Every step the engine can run: decode-only steps of 1..max_num_seqs requests and
    prefill/mixed steps of 1..max_num_batched_tokens tokens, padded to their bucket as
    dispatched, and the memory-profile step (the largest of all). None takes the fallback."""
    plan = plan_deployment(make_config(max_num_seqs=seqs, max_num_batched_tokens=budget, **graph))
    limit = plan.allreduce_fusion_max_tokens
    assert plan.allreduce_fusion and limit == max([budget, *plan.graph.prefill_capture_sizes])

    def padded(decode_only: bool, reqs: int, tokens: int) -> int:
        mode, bucket = plan.graph.dispatch(decode_only, reqs, tokens)
        return bucket if mode != "eager" else tokens

    largest = max(padded(True, b, b) for b in range(1, seqs + 1))
    largest = max(largest, *(padded(False, min(n, seqs), n) for n in range(1, budget + 1)))
    assert largest <= limit, (largest, limit)


@pytest.mark.slow
def test_layers_fused_path_fallback_and_biases(tmp_path):
    """TP=2 over gloo with a stand-in fused op (workspace for 8 tokens): the 5-token step runs
    every norm after a row-parallel layer fused (2 per layer: post-attention and the next input
    norm or the final norm), the 23-token step falls back for all of them, and both give the
    unsharded model's logits; the biases of o_proj and down_proj are counted once."""
    run_two_ranks(fusion_rank, tmp_path)
    layers = 3
    for rank in range(2):
        result = ast.literal_eval((tmp_path / f"fusion{rank}.txt").read_text())
        assert result["reduce"] == [False, False]
        assert result[5]["fused"] == 2 * layers and result[5]["fallback"] == 0
        assert result[23]["fused"] == 0 and result[23]["fallback"] == 2 * layers
        for n in (5, 23):
            assert result[n]["diff"] < 1e-4, (rank, n, result[n])
            assert result[n]["diff_unfused"] < 1e-4, (rank, n, result[n])
        full, fused = result["greedy"]
        assert fused == full and len(fused) == 6
