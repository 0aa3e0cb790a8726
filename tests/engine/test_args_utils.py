"""EngineArgs: keyword and CLI parsing, resolution of lengths, unsupported settings."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from fastdeploy.config.resolve import plan_deployment, resolve_deployment
from fastdeploy.engine.args_utils import EngineArgs
from fastdeploy.model_executor.model_loader.source import ModelSource


def source(max_position_embeddings: int | None) -> ModelSource:
    """A resolved model without a file: only its context limit matters here."""
    hf_config = argparse.Namespace(max_position_embeddings=max_position_embeddings)
    return ModelSource("unused", None, "dummy", hf_config, "unused")


def parse(*argv: str) -> EngineArgs:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    return EngineArgs.from_cli_args(parser.parse_args(list(argv)))


def test_from_kwargs_unknown_argument_names_close_match():
    with pytest.raises(ValueError) as err:
        EngineArgs.from_kwargs(max_num_seq=8)
    message = str(err.value)
    assert "unknown engine argument 'max_num_seq'" in message
    assert "did you mean max_num_seqs" in message


def test_from_kwargs_known_arguments():
    args = EngineArgs.from_kwargs(model="m.gguf", max_num_seqs=8)
    assert args.model == "m.gguf" and args.max_num_seqs == 8


def test_cli_defaults_equal_dataclass_defaults():
    assert parse() == EngineArgs()


def test_cli_every_field_has_a_flag_with_help():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    actions = {a.dest: a for a in parser._actions}
    for f in dataclasses.fields(EngineArgs):
        assert f.name in actions, f.name
        assert actions[f.name].option_strings[0] == "--" + f.name.replace("_", "-")
        assert actions[f.name].help


GRAPH_JSON = '{"full_cuda_graph": true, "cudagraph_capture_sizes": [1, 8]}'


def test_cli_round_trip():
    args = parse(
        "--model", "/models/qwen",
        "--tokenizer", "/models/tok",
        "--max-model-len", "4096",
        "--max-num-seqs", "32",
        "--max-num-batched-tokens", "8192",
        "--block-size", "16",
        "--gpu-memory-utilization", "0.8",
        "--num-gpu-blocks-override", "100",
        "--no-enable-chunked-prefill",
        "--dtype", "bfloat16",
        "--load-format", "safetensors",
        "--seed", "7",
        "--graph-optimization-config", GRAPH_JSON,
        "--splitwise-role", "prefill",
        "--swap-space", "2",
        "--swap-in-mode", "layerwise",
        "--host-store-policy", "all",
        "--tensor-parallel-size", "2",
        "--device", "cuda",
        "--attention-backend", "flashinfer",
    )  # fmt: skip
    assert args == EngineArgs(
        model="/models/qwen",
        tokenizer="/models/tok",
        max_model_len=4096,
        max_num_seqs=32,
        max_num_batched_tokens=8192,
        block_size=16,
        gpu_memory_utilization=0.8,
        num_gpu_blocks_override=100,
        enable_chunked_prefill=False,
        dtype="bfloat16",
        load_format="safetensors",
        seed=7,
        graph_optimization_config={"full_cuda_graph": True, "cudagraph_capture_sizes": [1, 8]},
        splitwise_role="prefill",
        swap_space=2.0,
        swap_in_mode="layerwise",
        host_store_policy="all",
        tensor_parallel_size=2,
        device="cuda",
        attention_backend="flashinfer",
    )
    config = args.create_engine_config(source(8192))
    assert config.graph_opt_config.full_cuda_graph
    assert config.scheduler_config.max_num_batched_tokens == 8192
    assert not config.scheduler_config.enable_chunked_prefill


def test_cli_bool_flags_both_ways():
    assert parse("--enable-chunked-prefill").enable_chunked_prefill is True
    assert parse("--no-enable-chunked-prefill").enable_chunked_prefill is False
    assert parse("--no-enable-prefix-caching").enable_prefix_caching is False


def test_cli_ignores_other_namespace_attributes():
    namespace = argparse.Namespace(port=8000, max_num_seqs=4)
    assert EngineArgs.from_cli_args(namespace) == EngineArgs(max_num_seqs=4)


@pytest.mark.parametrize(
    "argv",
    [
        ["--graph-optimization-config", "{not json}"],
        ["--graph-optimization-config", "[1, 2]"],
        ["--dtype", "fp8"],
        ["--max-num-seqs", "many"],
    ],
)
def test_cli_rejects_bad_values(argv, capsys):
    with pytest.raises(SystemExit):
        parse(*argv)
    assert argv[0] in capsys.readouterr().err


def test_graph_config_unknown_key_via_cli():
    args = parse("--graph-optimization-config", '{"full_cudagraph": true}')
    with pytest.raises(ValueError, match=r"'full_cudagraph'; did you mean full_cuda_graph"):
        args.create_engine_config(source(8192))


# ------------------------------------------------------------------ resolution
def test_max_model_len_resolution():
    assert EngineArgs().create_engine_config(source(8192)).model_config.max_model_len == 8192
    assert EngineArgs().create_engine_config(source(None)).model_config.max_model_len == 2048
    config = EngineArgs(max_model_len=1024).create_engine_config(source(8192))
    assert config.model_config.max_model_len == 1024


def test_max_model_len_above_model_maximum_is_an_error():
    with pytest.raises(ValueError) as err:
        EngineArgs(max_model_len=9000).create_engine_config(source(8192))
    message = str(err.value)
    assert "max_model_len=9000 is invalid" in message
    assert "max_position_embeddings=8192" in message


def test_max_model_len_wrong_type_is_reported_before_use():
    with pytest.raises(ValueError, match=r"max_model_len='4k' is invalid"):
        EngineArgs(max_model_len="4k").create_engine_config(source(8192))


@pytest.mark.parametrize(
    ("kwargs", "hf_max", "expected"),
    [
        ({}, 8192, 2048),  # chunked prefill: 2048
        ({"max_num_seqs": 4096}, 8192, 4096),  # ... but at least max_num_seqs
        ({"enable_chunked_prefill": False}, 8192, 8192),  # whole prompt in one step
        ({"enable_chunked_prefill": False}, 512, 2048),  # never below 2048
        ({"max_num_batched_tokens": 1024}, 8192, 1024),  # explicit value kept
        ({"max_num_seqs": 1, "max_model_len": 160}, 8192, 160),  # what one step can hold
        ({"max_num_seqs": 4, "max_model_len": 256}, 8192, 1024),
        ({"max_num_seqs": 2, "enable_chunked_prefill": False}, 512, 1024),
    ],
)
def test_max_num_batched_tokens_resolution(kwargs, hf_max, expected):
    config = EngineArgs(**kwargs).create_engine_config(source(hf_max))
    assert config.scheduler_config.max_num_batched_tokens == expected


def test_explicit_budget_above_what_a_step_can_hold_is_capped(caplog):
    args = EngineArgs(max_num_batched_tokens=4096, max_num_seqs=1, max_model_len=1024)
    with caplog.at_level("INFO", logger="fastdeploy.engine.args_utils"):
        config = args.create_engine_config(source(8192))
    assert config.scheduler_config.max_num_batched_tokens == 1024
    assert "max_num_batched_tokens=4096 capped at max_num_seqs * max_model_len = 1024" in (
        caplog.text
    )
    config = EngineArgs(max_num_batched_tokens=1000, max_num_seqs=1, max_model_len=1024)
    assert config.create_engine_config(source(8192)).scheduler_config.max_num_batched_tokens == 1000


def test_explicit_budget_below_max_model_len_without_chunking_is_an_error():
    args = EngineArgs(enable_chunked_prefill=False, max_num_batched_tokens=1024, max_num_seqs=8)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens=1024 .* max_model_len=4096"):
        args.create_engine_config(source(4096))


def test_attention_backend_falls_back_to_env(monkeypatch):
    monkeypatch.setenv("FD_ATTENTION_BACKEND", "torch_native")
    config = EngineArgs(device="cpu").create_engine_config(source(8192))
    assert config.device_config.attention_backend == "torch_native"
    config = EngineArgs(device="cuda", attention_backend="flashinfer").create_engine_config(
        source(8192)
    )
    assert config.device_config.attention_backend == "flashinfer"


def test_device_and_backend_are_resolved_before_the_policy(monkeypatch):
    """The resolved config records what will run; the policy only reads it."""
    monkeypatch.delenv("FD_ATTENTION_BACKEND", raising=False)
    config = EngineArgs(device="cpu").create_engine_config(source(8192))
    assert (config.device_config.device, config.device_config.attention_backend) == (
        "cpu",
        "torch_native",
    )
    config, plan = resolve_deployment(
        EngineArgs(device="cuda", attention_backend="torch_native"), source(8192)
    )
    assert config.device_config.attention_backend == "torch_native"
    assert not plan.graph.decode_graphs and plan.graph.prefill_graphs
    with pytest.raises(ValueError, match="needs a CUDA device"):
        EngineArgs(device="cpu", attention_backend="flashinfer").create_engine_config(source(8))


# ------------------------------------------------------------------ unsupported settings
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"splitwise_role": "decode", "tensor_parallel_size": 2},
            "splitwise_role='decode' with tensor_parallel_size=2 is not supported yet",
        ),
        (
            {"swap_space": 4, "tensor_parallel_size": 2},
            "swap_space=4 with tensor_parallel_size=2 is not supported yet",
        ),
        (
            {"swap_space": 4, "splitwise_role": "decode"},
            "swap_space=4 with splitwise_role='decode' is not supported yet",
        ),
    ],
)
def test_check_supported(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**kwargs).create_engine_config(source(8192)).check_supported()
    EngineArgs().create_engine_config(source(8192)).check_supported()
    for role in ("prefill", "decode"):  # PD roles run (tests/splitwise)
        EngineArgs(splitwise_role=role).create_engine_config(source(8192)).check_supported()
    for mode in ("request", "layerwise"):  # the host tier runs (tests/engine/test_host_tier*)
        args = EngineArgs(swap_space=4, swap_in_mode=mode, host_store_policy="all")
        args.create_engine_config(source(8192)).check_supported()
    EngineArgs(swap_space=4, splitwise_role="prefill").create_engine_config(
        source(8192)
    ).check_supported()


def test_swap_space_needs_prefix_caching():
    with pytest.raises(ValueError, match=r"swap_space=4 is invalid; allowed: 0 when enable_pre"):
        EngineArgs(swap_space=4, enable_prefix_caching=False).create_engine_config(source(8192))


def test_unsupported_config_still_resolves_a_plan(monkeypatch):
    """``--print-config`` must show a prefill node's plan: create_engine_config does not refuse."""
    monkeypatch.delenv("FD_USE_BLOCK_WISE_CUDA_GRAPH", raising=False)
    monkeypatch.delenv("FD_BLOCK_WISE_CUDA_GRAPH_SIZES", raising=False)
    args = EngineArgs(
        splitwise_role="prefill",
        swap_space=4,
        swap_in_mode="layerwise",
        tensor_parallel_size=2,
        device="cuda",
    )
    plan = resolve_deployment(args, source(8192))[1].graph
    assert not plan.decode_graphs and not plan.prefill_graphs
    assert any("swap_space=4 GiB" in r and "layer by layer" in r for r in plan.reasons)
    args = EngineArgs(splitwise_role="prefill", swap_space=4, tensor_parallel_size=2, device="cuda")
    plan = resolve_deployment(args, source(8192))[1].graph  # swap_in_mode=request
    assert plan.prefill_graphs and any("prefill graphs stay on" in r for r in plan.reasons)
    config = EngineArgs(splitwise_role="prefill", device="cuda").create_engine_config(source(64))
    plan = plan_deployment(config).graph
    assert plan.prefill_graphs and not plan.decode_graphs


def test_resolve_deployment_is_the_config_and_its_plan():
    """One call per start: the config of ``create_engine_config`` and the plan of that config."""
    args = EngineArgs(device="cpu", max_num_seqs=8)
    config, plan = resolve_deployment(args, source(512))
    assert config == args.create_engine_config(source(512))
    assert plan == plan_deployment(config)
    assert plan.graph.reasons and plan.overlap_schedule  # CPU: no graphs, the overlap stays on
