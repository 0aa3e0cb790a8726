"""Config validation: every error names the field, the value and the limit; JSON round trip."""

from __future__ import annotations

import dataclasses
import json

import pytest

from fastdeploy import envs
from fastdeploy.config import (
    CacheConfig,
    DeploymentPlan,
    DeviceConfig,
    FDConfig,
    GraphOptimizationConfig,
    GraphPlan,
    ModelConfig,
    SchedulerConfig,
)


def graph(**kw: object) -> GraphOptimizationConfig:
    return GraphOptimizationConfig.from_value(kw)


# ------------------------------------------------------------------ GraphOptimizationConfig
def test_graph_config_defaults():
    g = GraphOptimizationConfig.from_value(None)
    assert g.use_cudagraph and not g.full_cuda_graph and g.graph_opt_level == 0
    assert g.cudagraph_capture_sizes is None and g.cudagraph_capture_sizes_prefill is None
    assert g.max_capture_shape_prefill == 8192 and g.cudagraph_splitting_ops == ["attention"]


def test_graph_config_from_json_string():
    g = GraphOptimizationConfig.from_value('{"full_cuda_graph": true, "graph_opt_level": 1}')
    assert g.full_cuda_graph and g.graph_opt_level == 1


def test_graph_config_unknown_key_names_close_match():
    with pytest.raises(ValueError) as err:
        graph(use_cuda_graph=True)
    message = str(err.value)
    assert "unknown graph_optimization_config key 'use_cuda_graph'" in message
    assert "did you mean use_cudagraph" in message


def test_graph_config_unknown_key_without_close_match_lists_valid_keys():
    with pytest.raises(ValueError, match=r"'zzz'; valid keys: .*cudagraph_capture_sizes"):
        graph(zzz=1)


def test_graph_config_bad_json_and_non_object():
    with pytest.raises(ValueError, match="graph_optimization_config is not valid JSON"):
        GraphOptimizationConfig.from_value("{full_cuda_graph: true}")
    with pytest.raises(ValueError, match=r"graph_optimization_config=\[1\] is invalid"):
        GraphOptimizationConfig.from_value("[1]")


@pytest.mark.parametrize(
    ("key", "value", "allowed"),
    [
        ("use_cudagraph", "yes", "true or false"),
        ("full_cuda_graph", 1, "true or false"),
        ("cudagraph_only_prefill", None, "true or false"),
        ("graph_opt_level", 3, "0, 1 or 2"),
        ("graph_opt_level", True, "0, 1 or 2"),
        ("max_capture_shape_prefill", 0, "an integer >= 1"),
        ("max_capture_shape_prefill", "8192", "an integer >= 1"),
        ("cudagraph_num_of_warmups", -1, "an integer >= 0"),
        ("cudagraph_capture_sizes", "1,2,4", "a non-empty list"),
        ("cudagraph_capture_sizes", [], "a non-empty list"),
        ("cudagraph_capture_sizes", [1, 2.0], "positive integers"),
        ("cudagraph_capture_sizes_prefill", [16, True], "positive integers"),
        ("cudagraph_splitting_ops", ["attention", "moe"], '["attention"]'),
    ],
)
def test_graph_config_wrong_types(key, value, allowed):
    with pytest.raises(ValueError) as err:
        graph(**{key: value})
    message = str(err.value)
    assert message.startswith(f"{key}={value!r} is invalid; allowed: ")
    assert allowed in message


@pytest.mark.parametrize("key", ["cudagraph_capture_sizes", "cudagraph_capture_sizes_prefill"])
@pytest.mark.parametrize("bad", [0, -8])
def test_graph_config_non_positive_sizes(key, bad):
    with pytest.raises(ValueError) as err:
        graph(**{key: [4, bad]})
    assert f"{key}=[4, {bad}] is invalid" in str(err.value)
    assert f"positive integers (found {bad})" in str(err.value)


# ------------------------------------------------------------------ cross-field limits
def test_decode_size_above_max_num_seqs():
    with pytest.raises(ValueError) as err:
        FDConfig(
            scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=2048),
            graph_opt_config=graph(cudagraph_capture_sizes=[1, 8, 32]),
        )
    message = str(err.value)
    assert "cudagraph_capture_sizes=[1, 8, 32] is invalid" in message
    assert "max_num_seqs=16" in message and "found 32" in message


def test_decode_size_limit_checked_before_budget_is_resolved():
    with pytest.raises(ValueError, match=r"cudagraph_capture_sizes=\[512\].*max_num_seqs=256"):
        FDConfig(graph_opt_config=graph(cudagraph_capture_sizes=[512]))


def test_prefill_size_above_max_num_batched_tokens():
    with pytest.raises(ValueError) as err:
        FDConfig(
            scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=1024),
            graph_opt_config=graph(cudagraph_capture_sizes_prefill=[2048, 16]),
        )
    message = str(err.value)
    assert "cudagraph_capture_sizes_prefill=[2048, 16] is invalid" in message
    assert "max_num_batched_tokens=1024" in message and "found 2048" in message


def test_sizes_at_the_limits_are_accepted():
    config = FDConfig(
        scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=1024),
        graph_opt_config=graph(
            cudagraph_capture_sizes=[16], cudagraph_capture_sizes_prefill=[1024]
        ),
    )
    assert config.graph_opt_config.cudagraph_capture_sizes == [16]


def test_max_num_seqs_above_budget():
    with pytest.raises(
        ValueError, match=r"max_num_seqs=256 is invalid; allowed: <= max_num_batched_tokens=128"
    ):
        FDConfig(scheduler_config=SchedulerConfig(max_num_batched_tokens=128))


def test_budget_below_max_model_len_without_chunked_prefill():
    scheduler = SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=1024, enable_chunked_prefill=False
    )
    with pytest.raises(ValueError) as err:
        FDConfig(model_config=ModelConfig(max_model_len=4096), scheduler_config=scheduler)
    message = str(err.value)
    assert "max_num_batched_tokens=1024 is invalid" in message
    assert ">= max_model_len=4096 when enable_chunked_prefill is false" in message
    scheduler.enable_chunked_prefill = True  # fine with chunked prefill
    FDConfig(model_config=ModelConfig(max_model_len=4096), scheduler_config=scheduler)


# ------------------------------------------------------------------ other parts
@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: CacheConfig(swap_space=True), "swap_space=True is invalid"),
        (lambda: CacheConfig(swap_space=-1), "swap_space=-1 is invalid; allowed: a number of GiB"),
        (lambda: CacheConfig(gpu_memory_utilization=1.5), "gpu_memory_utilization=1.5 is invalid"),
        (lambda: CacheConfig(block_size=0), "block_size=0 is invalid; allowed: an integer >= 1"),
        (lambda: SchedulerConfig(max_num_seqs=0), "max_num_seqs=0 is invalid"),
        (lambda: ModelConfig(dtype="fp8"), "dtype='fp8' is invalid; allowed: auto, float32"),
        (lambda: ModelConfig(model=3), "model=3 is invalid"),
        (lambda: DeviceConfig(attention_backend=1), "attention_backend=1 is invalid"),
        (lambda: FDConfig(cache_config={}), "cache_config={} is invalid; allowed: CacheConfig"),
    ],
)
def test_part_validation(make, message):
    with pytest.raises(ValueError) as err:
        make()
    assert message in str(err.value)


# ------------------------------------------------------------------ round trip
def test_fdconfig_round_trips_through_json():
    config = FDConfig(
        model_config=ModelConfig(model="/models/x", max_model_len=4096, dtype="bfloat16"),
        cache_config=CacheConfig(block_size=16, swap_space=4),
        scheduler_config=SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=4096),
        graph_opt_config=graph(
            full_cuda_graph=True, cudagraph_capture_sizes=[1, 2, 32], graph_opt_level=1
        ),
    )
    again = FDConfig.from_dict(json.loads(json.dumps(config.to_dict())))
    assert again == config
    assert again.to_dict() == config.to_dict()


def test_fdconfig_from_dict_rejects_unknown_part_and_key():
    data = FDConfig().to_dict()
    with pytest.raises(ValueError, match=r"unknown config part 'graph_opt_cfg'.*graph_opt_config"):
        FDConfig.from_dict({**data, "graph_opt_cfg": {}})
    data["scheduler_config"]["max_num_seq"] = 4
    with pytest.raises(ValueError, match=r"unknown scheduler_config key 'max_num_seq'.*max_num_s"):
        FDConfig.from_dict(data)


# ------------------------------------------------------------------ environment variables
def test_envs_are_read_lazily_and_typed(monkeypatch):
    monkeypatch.delenv("FD_CPU_KV_CACHE_SPACE", raising=False)
    monkeypatch.delenv("FD_ATTENTION_BACKEND", raising=False)
    assert envs.FD_CPU_KV_CACHE_SPACE() == 1.0
    assert envs.FD_ATTENTION_BACKEND() is None
    monkeypatch.setenv("FD_CPU_KV_CACHE_SPACE", "1.5")
    monkeypatch.setenv("FD_ATTENTION_BACKEND", "torch_native")
    monkeypatch.setenv("FD_DEBUG_CUDAGRAPH_ADDRESSES", "TRUE")
    monkeypatch.setenv("FD_LOG_LEVEL", "debug")
    assert envs.FD_CPU_KV_CACHE_SPACE() == 1.5
    assert envs.FD_ATTENTION_BACKEND() == "torch_native"
    assert envs.FD_DEBUG_CUDAGRAPH_ADDRESSES() is True
    assert envs.FD_LOG_LEVEL() == "DEBUG"
    assert envs.get("FD_LOG_LEVEL") == "DEBUG"


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("FD_DEBUG_CUDAGRAPH_ADDRESSES", "maybe", "allowed: 1, true"),
        ("FD_CPU_KV_CACHE_SPACE", "0", "allowed: a number > 0"),
        ("FD_CPU_KV_CACHE_SPACE", "lots", "allowed: a number > 0"),
        ("FD_LOG_LEVEL", "LOUD", "allowed: DEBUG, INFO"),
    ],
)
def test_envs_malformed_values(monkeypatch, name, value, message):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=rf"{name}='{value}' is invalid; {message}"):
        envs.get(name)


def test_envs_misuse_is_loud():
    with pytest.raises(TypeError, match=r"call envs.FD_DEBUG_CUDAGRAPH_ADDRESSES\(\)"):
        bool(envs.FD_DEBUG_CUDAGRAPH_ADDRESSES)
    with pytest.raises(KeyError, match="FD_LOG_LEVEL"):
        envs.get("FD_LOG_LEVL")
    assert {v.name for v in envs.describe()} >= {"FD_LOG_LEVEL", "FD_USE_BLOCK_WISE_CUDA_GRAPH"}


def test_use_unique_memory_pool_false_is_refused_with_the_reason():
    """One pool is the design; the knob exists for FastDeploy users' configs and only accepts it."""
    assert GraphOptimizationConfig(use_unique_memory_pool=True).use_unique_memory_pool
    with pytest.raises(ValueError) as err:
        GraphOptimizationConfig.from_value('{"use_unique_memory_pool": false}')
    message = str(err.value)
    assert "use_unique_memory_pool=False is invalid" in message
    assert "shares one memory pool by design" in message


@pytest.mark.slow
@pytest.mark.parametrize(("value", "level"), [("debug", 10), ("WARNING", 30), ("", 0)])
def test_fd_log_level_sets_the_fastdeploy_logger(value, level):
    """FD_LOG_LEVEL does what its name says: the level of the 'fastdeploy' loggers (unset or
    empty: they inherit, level 0)."""
    import os
    import subprocess
    import sys

    code = (
        "import logging, fastdeploy; "
        "print(logging.getLogger('fastdeploy').level, "
        "logging.getLogger('fastdeploy.engine.engine').getEffectiveLevel())"
    )
    env = {**os.environ, "FD_LOG_LEVEL": value}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    assert int(out[0]) == level
    if level:
        assert int(out[1]) == level


# ---------------------------------------------------------------- the deployment plan
def _plan(**kwargs) -> DeploymentPlan:
    graph = GraphPlan(
        decode_graphs=True,
        prefill_graphs=False,
        decode_capture_sizes=[4, 2, 1],
        prefill_capture_sizes=[],
        reasons=["prefill graphs off: full_cuda_graph=true"],
    )
    return DeploymentPlan(graph=graph, **kwargs)


def test_deployment_plan_round_trips_through_json_and_is_frozen():
    plan = _plan(
        allreduce_fusion=True, allreduce_fusion_max_tokens=512, reasons=("allreduce fusion on",)
    )
    data = json.loads(json.dumps(plan.to_dict()))
    assert set(data) == {
        "graph",
        "overlap_schedule",
        "allreduce_fusion",
        "allreduce_fusion_max_tokens",
        "reasons",
    }
    assert DeploymentPlan.from_dict(data) == plan
    assert plan.all_reasons == ["prefill graphs off: full_cuda_graph=true", "allreduce fusion on"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.overlap_schedule = True  # type: ignore[misc]
    assert "overlap schedule: off" in plan.describe() and "decode graphs (full): on" in (
        plan.describe()
    )


def test_deployment_plan_refuses_unknown_keys_and_inconsistency():
    data = _plan().to_dict()
    with pytest.raises(
        ValueError, match=r"unknown deployment plan key 'overlap'.*overlap_schedule"
    ):
        DeploymentPlan.from_dict({**data, "overlap": True})
    with pytest.raises(ValueError, match=r"allreduce_fusion_max_tokens=0 is invalid"):
        _plan(allreduce_fusion=True)
    with pytest.raises(ValueError, match=r"allreduce_fusion_max_tokens=8 is invalid"):
        _plan(allreduce_fusion_max_tokens=8)
    with pytest.raises(ValueError, match=r"overlap_schedule=1 is invalid"):
        _plan(overlap_schedule=1)
