"""The graph policy: one test per rule of the specification, plus the block-wise env vars."""

from __future__ import annotations

import json
import logging

import pytest

from fastdeploy.config import (
    CacheConfig,
    DeploymentPlan,
    DeviceConfig,
    FDConfig,
    GraphOptimizationConfig,
    ParallelConfig,
    SchedulerConfig,
)
from fastdeploy.config.resolve import plan_deployment
from fastdeploy.model_executor.graph_optimization.capture_sizes import (
    default_decode_sizes,
    default_prefill_sizes,
)
from fastdeploy.model_executor.graph_optimization.policy import (
    GraphPlan,
    check_block_wise_env,
    resolve_graph_plan,
)
from fastdeploy.platforms import get_platform


@pytest.fixture(autouse=True)
def _no_block_wise_env(monkeypatch):
    monkeypatch.delenv("FD_USE_BLOCK_WISE_CUDA_GRAPH", raising=False)
    monkeypatch.delenv("FD_BLOCK_WISE_CUDA_GRAPH_SIZES", raising=False)


def make_config(
    *,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 512,
    splitwise_role: str = "mixed",
    swap_space: float = 0,
    swap_in_mode: str = "request",
    platform: str = "cuda",
    **graph: object,
) -> FDConfig:
    """A resolved config on ``platform`` with its default attention backend."""
    return FDConfig(
        device_config=DeviceConfig(
            device=platform, attention_backend=get_platform(platform).default_attention_backend
        ),
        cache_config=CacheConfig(swap_space=swap_space, swap_in_mode=swap_in_mode),
        parallel_config=ParallelConfig(splitwise_role=splitwise_role),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens
        ),
        graph_opt_config=GraphOptimizationConfig(**graph),
    )


def has_reason(plan: GraphPlan | DeploymentPlan, *fragments: str) -> bool:
    reasons = plan.all_reasons if isinstance(plan, DeploymentPlan) else plan.reasons
    return any(all(f in r for f in fragments) for r in reasons)


def test_default_cuda_plan_turns_both_on():
    plan = resolve_graph_plan(make_config())
    assert plan.decode_graphs and plan.prefill_graphs
    assert plan.decode_capture_sizes == default_decode_sizes(64)
    assert plan.prefill_capture_sizes == default_prefill_sizes(8192, 512)
    assert plan.capture_in_background  # rule 8b: serve from the first second
    assert len(plan.reasons) == 1 and has_reason(plan, "captured in the background")


def test_rule8b_when_the_graphs_are_captured():
    off = resolve_graph_plan(make_config(capture_in_background=False))
    assert not off.capture_in_background
    assert has_reason(off, "captured before serving", "capture_in_background=false")
    compiled = resolve_graph_plan(make_config(graph_opt_level=1))
    assert not compiled.capture_in_background
    assert has_reason(compiled, "captured before serving", "graph_opt_level=1", "tens of seconds")
    for role in ("prefill", "decode"):
        pd = resolve_graph_plan(make_config(splitwise_role=role))
        assert not pd.capture_in_background
        assert has_reason(pd, "captured before serving", f"splitwise_role={role}", "KV transfer")
    cpu = resolve_graph_plan(make_config(platform="cpu"))  # nothing to capture: no timing rule
    assert not cpu.capture_in_background
    assert not has_reason(cpu, "captured")
    assert GraphPlan.from_dict(off.to_dict()) == off
    with pytest.raises(ValueError, match="capture_in_background"):
        GraphPlan(False, False, [], [], capture_in_background=True)


def test_rule1_cpu_platform_turns_all_off():
    plan = resolve_graph_plan(make_config(platform="cpu"))
    assert not plan.decode_graphs and not plan.prefill_graphs
    assert plan.decode_capture_sizes == [] and plan.prefill_capture_sizes == []
    assert has_reason(plan, "all graphs off", "'cpu'", "cannot capture")


def test_unresolved_device_or_unknown_backend_is_an_error():
    config = make_config()
    config.device_config = DeviceConfig(device="auto", attention_backend="flashinfer")
    with pytest.raises(
        ValueError, match=r"device_config=.*'auto'.*EngineArgs.create_engine_config"
    ):
        resolve_graph_plan(config)
    config.device_config = DeviceConfig(device="cuda", attention_backend=None)
    with pytest.raises(ValueError, match=r"device_config=.*None.*resolved"):
        resolve_graph_plan(config)
    config.device_config = DeviceConfig(device="cuda", attention_backend="flashattn")
    with pytest.raises(ValueError, match=r"unknown attention backend 'flashattn'; valid"):
        resolve_graph_plan(config)


def test_rule2_use_cudagraph_false_turns_all_off():
    plan = resolve_graph_plan(make_config(use_cudagraph=False))
    assert not plan.decode_graphs and not plan.prefill_graphs
    assert plan.decode_capture_sizes == [] and plan.prefill_capture_sizes == []
    assert has_reason(plan, "all graphs off", "use_cudagraph=false")


def test_rule3_full_cuda_graph_turns_prefill_off():
    plan = resolve_graph_plan(make_config(full_cuda_graph=True))
    assert plan.decode_graphs and plan.decode_capture_sizes == default_decode_sizes(64)
    assert not plan.prefill_graphs and plan.prefill_capture_sizes == []
    assert has_reason(plan, "prefill graphs off", "full_cuda_graph=true")


def test_rule4_prefill_node_decode_off_prefill_on():
    plan = resolve_graph_plan(make_config(splitwise_role="prefill"))
    assert not plan.decode_graphs and plan.decode_capture_sizes == []
    assert plan.prefill_graphs and plan.prefill_capture_sizes == default_prefill_sizes(8192, 512)
    assert has_reason(plan, "decode graphs off", "splitwise_role=prefill")


def test_rule4_prefill_node_with_full_cuda_graph_has_nothing_to_capture():
    plan = resolve_graph_plan(make_config(splitwise_role="prefill", full_cuda_graph=True))
    assert not plan.any_graphs
    assert plan.decode_capture_sizes == [] and plan.prefill_capture_sizes == []
    assert has_reason(plan, "nothing to capture", "prefill node", "full_cuda_graph=true")


def test_rule5_decode_node_turns_prefill_off():
    plan = resolve_graph_plan(make_config(splitwise_role="decode"))
    assert plan.decode_graphs and plan.decode_capture_sizes == default_decode_sizes(64)
    assert not plan.prefill_graphs and plan.prefill_capture_sizes == []
    assert has_reason(plan, "prefill graphs off", "splitwise_role=decode")


def test_rule6_cudagraph_only_prefill_turns_decode_off():
    plan = resolve_graph_plan(make_config(cudagraph_only_prefill=True))
    assert not plan.decode_graphs and plan.decode_capture_sizes == []
    assert plan.prefill_graphs and plan.prefill_capture_sizes == default_prefill_sizes(8192, 512)
    assert has_reason(plan, "decode graphs off", "cudagraph_only_prefill=true")


def test_rule7_layerwise_swap_in_turns_prefill_off_decode_unaffected():
    plan = resolve_graph_plan(make_config(swap_space=4, swap_in_mode="layerwise"))
    assert plan.decode_graphs and plan.decode_capture_sizes == default_decode_sizes(64)
    assert not plan.prefill_graphs and plan.prefill_capture_sizes == []
    assert has_reason(plan, "prefill graphs off", "host KV tier", "swap_space=4 GiB", "layer by")


def test_rule7_applies_to_prefill_node_path():
    """The combination the upstream change missed: prefill node + swap space + piecewise."""
    config = make_config(
        splitwise_role="prefill", swap_space=2.5, swap_in_mode="layerwise", full_cuda_graph=False
    )
    plan = resolve_graph_plan(config)
    assert not plan.prefill_graphs and plan.prefill_capture_sizes == []
    assert not plan.decode_graphs
    assert has_reason(plan, "prefill graphs off", "host KV tier", "swap_space=2.5 GiB")
    assert has_reason(plan, "nothing to capture")


def test_rule7_applies_to_cudagraph_only_prefill_path():
    plan = resolve_graph_plan(
        make_config(cudagraph_only_prefill=True, swap_space=1, swap_in_mode="layerwise")
    )
    assert not plan.any_graphs
    assert has_reason(plan, "prefill graphs off", "swap_space=1 GiB", "layerwise")


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"splitwise_role": "prefill"}, {"cudagraph_only_prefill": True}],
    ids=["mixed", "prefill_node", "cudagraph_only_prefill"],
)
def test_rule7_request_swap_in_keeps_prefill_graphs_with_a_reason(kwargs):
    """swap_in_mode=request (the default) lands copies before a request's first step: prefill
    graphs stay on on every path, and the plan says why."""
    plan = resolve_graph_plan(make_config(swap_space=4, **kwargs))
    assert plan.prefill_graphs and plan.prefill_capture_sizes == default_prefill_sizes(8192, 512)
    assert has_reason(plan, "prefill graphs stay on", "swap_in_mode=request", "swap_space=4 GiB")
    assert not has_reason(plan, "prefill graphs off")


def test_rule7_reason_only_where_it_decides():
    """No host tier: no rule-7 line; prefill graphs already off for another reason: no claim
    that they stay on."""
    assert not has_reason(resolve_graph_plan(make_config()), "swap_in_mode")
    plan = resolve_graph_plan(make_config(swap_space=4, full_cuda_graph=True))
    assert not plan.prefill_graphs and not has_reason(plan, "stay on")


def test_rule8_default_ladders_capped():
    plan = resolve_graph_plan(make_config(max_num_seqs=20, max_num_batched_tokens=50))
    assert plan.decode_capture_sizes == [20, 16, 8, 4, 2, 1]
    assert plan.prefill_capture_sizes == [50, 48, 40, 32, 24, 16, 8, 4, 2, 1]
    big = make_config(max_num_seqs=1024, max_num_batched_tokens=16384)
    plan = resolve_graph_plan(big)
    assert max(plan.decode_capture_sizes) == 512  # min(512, max_num_seqs)
    assert max(plan.prefill_capture_sizes) == 8192  # min(max_capture_shape_prefill, budget)
    capped = make_config(max_num_batched_tokens=4096, max_capture_shape_prefill=1000)
    assert max(resolve_graph_plan(capped).prefill_capture_sizes) == 1000


def test_rule8_explicit_sizes_deduplicated_sorted_not_truncated():
    config = make_config(
        cudagraph_capture_sizes=[1, 64, 8, 8], cudagraph_capture_sizes_prefill=[16, 512, 3]
    )
    plan = resolve_graph_plan(config)
    assert plan.decode_capture_sizes == [64, 8, 1]
    assert plan.prefill_capture_sizes == [512, 16, 3]


def test_rule8_explicit_sizes_above_limits_are_errors_even_after_edit():
    config = make_config()
    config.graph_opt_config.cudagraph_capture_sizes = [128]  # edited after validation
    with pytest.raises(ValueError, match=r"cudagraph_capture_sizes=\[128\].*max_num_seqs=64"):
        resolve_graph_plan(config)


def test_unresolved_budget_is_an_error_when_prefill_graphs_are_on():
    config = make_config()
    config.scheduler_config = SchedulerConfig()  # max_num_batched_tokens=None: not resolved
    with pytest.raises(ValueError, match=r"max_num_batched_tokens=None is invalid.*resolved"):
        resolve_graph_plan(config)
    config.device_config = DeviceConfig(device="cpu", attention_backend="torch_native")
    assert resolve_graph_plan(config).reasons  # nothing needs the budget off CUDA


def test_graph_opt_level_and_full_cuda_graph_live_in_the_config_alone():
    """The plan does not copy them: the capture reads ``config.graph_opt_config``."""
    config = make_config(graph_opt_level=2, full_cuda_graph=True)
    data = resolve_graph_plan(config).to_dict()
    assert "graph_opt_level" not in data and "full_cuda_graph" not in data
    assert config.graph_opt_config.graph_opt_level == 2


def test_plan_round_trips_through_json():
    plan = resolve_graph_plan(make_config(swap_space=4))
    again = GraphPlan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again == plan
    assert "decode graphs (full): on" in again.describe()


def test_plan_from_dict_rejects_unknown_key_and_inconsistency():
    data = resolve_graph_plan(make_config()).to_dict()
    with pytest.raises(ValueError, match=r"unknown graph plan key 'decode_graph'.*decode_graphs"):
        GraphPlan.from_dict({**data, "decode_graph": True})
    with pytest.raises(ValueError, match=r"decode_capture_sizes=\[\] is invalid"):
        GraphPlan.from_dict({**data, "decode_capture_sizes": []})
    with pytest.raises(ValueError, match=r"prefill_capture_sizes=\[1, 2\] is invalid.*largest"):
        GraphPlan.from_dict({**data, "prefill_capture_sizes": [1, 2]})


def test_rule10_overlap_schedule_is_on_by_default_and_says_what_it_costs_on_cpu():
    plan = plan_deployment(make_config())
    assert plan.overlap_schedule and "overlap schedule: on" in plan.describe()
    assert not has_reason(plan, "overlap schedule")  # on CUDA it overlaps: nothing to explain
    cpu = plan_deployment(make_config(platform="cpu"))
    assert cpu.overlap_schedule
    assert has_reason(cpu, "overlap schedule on", "nothing overlaps", "--disable-overlap-schedule")


@pytest.mark.parametrize(
    "edit, fragment",
    [
        (lambda c: setattr(c.scheduler_config, "disable_overlap_schedule", True),
         "disable_overlap_schedule=true"),
        (lambda c: setattr(c.parallel_config, "tensor_parallel_size", 2),
         "tensor_parallel_size=2"),
        (lambda c: setattr(c.parallel_config, "splitwise_role", "prefill"),
         "splitwise_role=prefill"),
        (lambda c: setattr(c.parallel_config, "splitwise_role", "decode"),
         "splitwise_role=decode"),
        (lambda c: setattr(c.cache_config, "swap_space", 4), "host KV tier"),
    ],
)  # fmt: skip
def test_rule10_overlap_schedule_off_says_why(edit, fragment):
    config = make_config()
    edit(config)
    plan = plan_deployment(config)
    assert not plan.overlap_schedule and "overlap schedule: off" in plan.describe()
    assert has_reason(plan, "overlap schedule off", fragment)
    again = DeploymentPlan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again == plan


# ---------------------------------------------------------------- dispatch (pure, every branch)
def test_dispatch_decode_only_replays_the_smallest_decode_bucket():
    plan = resolve_graph_plan(make_config(max_num_seqs=20, max_num_batched_tokens=50))
    assert plan.dispatch(True, 3, 3) == ("full", 4)
    assert plan.dispatch(True, 4, 4) == ("full", 4)  # exact hit: no padding
    assert plan.dispatch(True, 1, 1) == ("full", 1)
    assert plan.dispatch(True, 20, 20) == ("full", 20)


def test_dispatch_decode_above_the_largest_decode_bucket_runs_eagerly():
    """The rule once hidden in the graph runner: never a piecewise bucket for such a step."""
    config = make_config(
        max_num_seqs=64, cudagraph_capture_sizes=[8, 4], cudagraph_capture_sizes_prefill=[64]
    )
    plan = resolve_graph_plan(config)
    assert plan.dispatch(True, 9, 9) == ("eager", None)  # a 64-token piecewise bucket would fit


def test_dispatch_prefill_and_mixed_replay_the_smallest_token_bucket():
    plan = resolve_graph_plan(make_config(max_num_seqs=20, max_num_batched_tokens=50))
    assert plan.dispatch(False, 1, 49) == ("piecewise", 50)
    assert plan.dispatch(False, 3, 17) == ("piecewise", 24)  # mixed: 3 requests, 17 tokens
    assert plan.dispatch(False, 1, 8) == ("piecewise", 8)


def test_dispatch_prefill_above_the_largest_token_bucket_runs_eagerly():
    config = make_config(max_num_batched_tokens=64, cudagraph_capture_sizes_prefill=[32, 16])
    plan = resolve_graph_plan(config)
    assert plan.dispatch(False, 1, 33) == ("eager", None)


def test_dispatch_decode_only_without_decode_graphs_takes_a_piecewise_bucket():
    plan = resolve_graph_plan(make_config(cudagraph_only_prefill=True))
    assert not plan.decode_graphs
    assert plan.dispatch(True, 3, 3) == ("piecewise", 4)


def test_dispatch_with_prefill_graphs_off():
    plan = resolve_graph_plan(make_config(full_cuda_graph=True))
    assert plan.dispatch(False, 1, 16) == ("eager", None)
    assert plan.dispatch(True, 2, 2) == ("full", 2)


def test_dispatch_with_all_graphs_off_is_always_eager():
    plan = resolve_graph_plan(make_config(platform="cpu"))
    assert not plan.any_graphs
    assert plan.dispatch(True, 1, 1) == ("eager", None)
    assert plan.dispatch(False, 1, 16) == ("eager", None)


# ---------------------------------------------------------------- block-wise environment variables
BLOCK_WISE = ["FD_USE_BLOCK_WISE_CUDA_GRAPH", "FD_BLOCK_WISE_CUDA_GRAPH_SIZES"]


@pytest.mark.parametrize("name", BLOCK_WISE)
@pytest.mark.parametrize("value", ["1", "true", "1,2,4"])
def test_block_wise_true_value_stops_startup(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError) as err:
        check_block_wise_env()
    message = str(err.value)
    assert name in message and "block-wise CUDA graphs are gone" in message
    assert '{"full_cuda_graph": false}' in message
    with pytest.raises(ValueError, match="block-wise"):  # the policy calls it
        resolve_graph_plan(make_config())


@pytest.mark.parametrize("name", BLOCK_WISE)
def test_block_wise_zero_only_warns(monkeypatch, caplog, name):
    monkeypatch.setenv(name, "0")
    with caplog.at_level(logging.WARNING):
        plan = resolve_graph_plan(make_config())
    assert plan.decode_graphs and plan.prefill_graphs
    assert any(name in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)


def test_block_wise_unset_or_empty_is_silent(monkeypatch, caplog):
    monkeypatch.setenv("FD_USE_BLOCK_WISE_CUDA_GRAPH", "")
    with caplog.at_level(logging.WARNING):
        check_block_wise_env()
    assert caplog.records == []


def test_torch_native_attention_turns_decode_graphs_off_keeps_piecewise():
    config = make_config()
    config.device_config = DeviceConfig(device="cuda", attention_backend="torch_native")
    plan = resolve_graph_plan(config)  # the backend class says it cannot capture decode
    assert not plan.decode_graphs and plan.decode_capture_sizes == []
    assert plan.prefill_graphs and plan.prefill_capture_sizes
    assert has_reason(plan, "decode graphs off", "torch_native")
