"""The ``fastdeploy`` CLI parser: ``serve`` takes exactly the api_server module's arguments."""

from __future__ import annotations

import dataclasses

import pytest

from fastdeploy.engine.args_utils import EngineArgs
from fastdeploy.entrypoints.cli.main import build_parser
from fastdeploy.entrypoints.openai.api_server import make_arg_parser, served_name


def _options(parser) -> set[str]:
    return {opt for action in parser._actions for opt in action.option_strings}


def test_serve_and_module_share_arguments():
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    assert _options(serve) == _options(make_arg_parser())
    for f in dataclasses.fields(EngineArgs):
        assert "--" + f.name.replace("_", "-") in _options(serve)


def test_serve_parses_engine_and_server_flags():
    args = build_parser().parse_args(
        [
            "serve",
            "--port",
            "9001",
            "--max-num-seqs",
            "8",
            "--max-concurrency",
            "4",
            "--graph-optimization-config",
            '{"use_cudagraph": false}',
            "--no-enable-prefix-caching",
        ]
    )
    engine_args = EngineArgs.from_cli_args(args)
    assert (args.port, args.max_concurrency, engine_args.max_num_seqs) == (9001, 4, 8)
    assert engine_args.graph_optimization_config == {"use_cudagraph": False}
    assert engine_args.enable_prefix_caching is False
    assert served_name(args) == "SmolLM2-135M-Instruct"
    assert served_name(build_parser().parse_args(["serve", "--model", "/m/x"])) == "/m/x"


def test_serve_rejects_bad_json_and_missing_command(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--graph-optimization-config", "{nope"])
    assert "not valid JSON" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args([])


def test_bad_port_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--port", "99999"])
    assert "--port='99999' is invalid; allowed: 0..65535" in capsys.readouterr().err


def test_print_config_of_a_prefill_node_with_swap_space_on_cuda(capsys, monkeypatch):
    """The plan of a deployment that this build cannot run yet is still printed, with the
    policy's reasons and what is not supported yet (spec rule 7 on the prefill-node path)."""
    import json

    from fastdeploy.config import FDConfig
    from fastdeploy.entrypoints.openai.api_server import run_server as run

    monkeypatch.delenv("FD_USE_BLOCK_WISE_CUDA_GRAPH", raising=False)
    args = build_parser().parse_args(
        ["serve", "--print-config", "--device", "cuda", "--splitwise-role", "prefill",
         "--swap-space", "4", "--graph-optimization-config", '{"full_cuda_graph": false}']
    )  # fmt: skip
    assert run(args) == 0
    out = json.loads(capsys.readouterr().out)
    plan = out["graph_plan"]
    assert not plan["decode_graphs"] and not plan["prefill_graphs"]
    assert any("swap_space" in r for r in plan["reasons"])
    assert "splitwise_role" in out["not_supported_yet"]
    assert FDConfig.from_dict(out["config"]).parallel_config.splitwise_role == "prefill"


def test_print_config_resolves_the_backend_before_the_plan(capsys, monkeypatch):
    """The resolved config records the backend the plan was made for; naming flashinfer shows a
    flashinfer host's plan on any machine, and torch_native on CUDA turns decode graphs off with
    the backend's reason."""
    import json

    from fastdeploy.entrypoints.openai.api_server import run_server as run

    monkeypatch.delenv("FD_ATTENTION_BACKEND", raising=False)
    for backend, decode in (("flashinfer", True), ("torch_native", False)):
        args = build_parser().parse_args(
            ["serve", "--print-config", "--device", "cuda", "--attention-backend", backend]
        )
        assert run(args) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["config"]["device_config"] == {"device": "cuda", "attention_backend": backend}
        assert out["graph_plan"]["decode_graphs"] is decode
        assert out["graph_plan"]["prefill_graphs"] is True
        if not decode:
            assert any(
                "torch_native attention backend cannot run inside a full CUDA graph" in r
                for r in out["graph_plan"]["reasons"]
            )
