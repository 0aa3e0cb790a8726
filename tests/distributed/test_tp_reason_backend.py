"""The tensor-parallel rule's reason names the collective backend the run actually uses: a
gloo run on CPU must not read "NCCL" (a first-hour friction of issue #44)."""

from __future__ import annotations

from test_allreduce_fusion import make_config

from fastdeploy.config.resolve import plan_deployment
from fastdeploy.platforms import get_platform


def fusion_reason(platform: str) -> str:
    plan = plan_deployment(make_config(platform=platform, fusion=False))
    (reason,) = [r for r in plan.reasons if r.startswith("allreduce fusion")]
    return reason


def test_platforms_name_their_collective_backend():
    assert get_platform("cuda").collective_backend == "nccl"
    assert get_platform("cpu").collective_backend == "gloo"


def test_cpu_reason_names_gloo_not_nccl():
    reason = fusion_reason("cpu")
    assert "gloo all-reduce" in reason
    assert "nccl" not in reason.lower()


def test_cuda_reason_names_nccl():
    reason = fusion_reason("cuda")
    assert "nccl all-reduce" in reason
    assert "gloo" not in reason
