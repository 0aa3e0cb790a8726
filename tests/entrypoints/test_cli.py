"""The ``fastdeploy`` CLI: ``serve`` takes exactly the api_server module's arguments, and start-up
refuses what it can before the model loads with one ``error:`` line and exit status 2."""

from __future__ import annotations

import dataclasses
import socket
import subprocess
import sys
import time

import pytest
import torch

from fastdeploy.engine.args_utils import EngineArgs
from fastdeploy.entrypoints.cli.main import build_parser
from fastdeploy.entrypoints.server_args import make_arg_parser, served_name


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


PREFILL_PATHS = {
    "mixed": [],
    "prefill_node": ["--splitwise-role", "prefill", "--graph-optimization-config",
                     '{"full_cuda_graph": false}'],
    "cudagraph_only_prefill": ["--graph-optimization-config", '{"cudagraph_only_prefill": true}'],
}  # fmt: skip


@pytest.mark.parametrize("mode", ["layerwise", "request"])
@pytest.mark.parametrize("path", list(PREFILL_PATHS))
def test_print_config_with_swap_space_on_cuda(capsys, monkeypatch, path, mode):
    """Spec rule 7 on every path that turns prefill graphs on (the default, a prefill node,
    cudagraph_only_prefill): a layer-by-layer host tier turns them off and --print-config says
    why; request-mode swap-ins keep them on, and say that too. Both run (nothing is "not
    supported yet")."""
    import json

    from fastdeploy.config import FDConfig
    from fastdeploy.entrypoints.openai.api_server import run_server as run

    monkeypatch.delenv("FD_USE_BLOCK_WISE_CUDA_GRAPH", raising=False)
    args = build_parser().parse_args(
        ["serve", "--print-config", "--device", "cuda", "--swap-space", "4",
         "--swap-in-mode", mode, *PREFILL_PATHS[path]]
    )  # fmt: skip
    assert run(args) == 0
    out = json.loads(capsys.readouterr().out)
    plan = out["deployment_plan"]["graph"]
    reasons = [r for r in plan["reasons"] if "swap_space=4 GiB" in r]
    assert len(reasons) == 1, plan["reasons"]  # one line, about prefill graphs only
    if mode == "layerwise":
        assert not plan["prefill_graphs"]
        assert reasons[0].startswith("prefill graphs off") and "layer by layer" in reasons[0]
    else:
        assert plan["prefill_graphs"]
        assert reasons[0].startswith("prefill graphs stay on: swap_in_mode=request")
    assert out["not_supported_yet"] is None
    config = FDConfig.from_dict(out["config"])
    assert config.cache_config.swap_in_mode == mode and config.cache_config.swap_space == 4


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
        graph = out["deployment_plan"]["graph"]
        assert graph["decode_graphs"] is decode and graph["prefill_graphs"] is True
        if not decode:
            assert any(
                "torch_native attention backend cannot run inside a full CUDA graph" in r
                for r in graph["reasons"]
            )


# ----------------------------------------------------------------- a new user's first hour
CLI = [sys.executable, "-m", "fastdeploy.entrypoints.cli.main", "serve"]


def run_cli(*argv: str, timeout: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    out = subprocess.run([*CLI, *argv], capture_output=True, text=True, timeout=timeout)
    return out, time.monotonic() - started


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_cuda_is_one_error_line_and_exit_2():
    out, seconds = run_cli("--device", "cuda", "--port", "0")
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("error: device='cuda' is invalid on this machine")
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    assert "no CUDA support" in out.stderr or "no CUDA device is visible" in out.stderr
    assert seconds < 60  # refused before the model's config is read


@pytest.mark.slow
def test_a_port_in_use_is_refused_before_the_model_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out, _ = run_cli("--host", "127.0.0.1", "--port", str(port), "--device", "cpu")
    assert out.returncode == 2, out.stderr
    assert out.stderr == (
        f"error: --port={port} is invalid: cannot bind 127.0.0.1:{port} (Address already in "
        "use); another process is listening there; stop it or pick another --port\n"
    )


def test_serve_help_shows_the_cpu_kv_cache_space():
    text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    assert "FD_CPU_KV_CACHE_SPACE (default: 1.0)" in text
    assert "GiB of host memory given to the KV cache" in text


@pytest.mark.slow
def test_print_config_imports_neither_the_web_stack_nor_the_engine():
    code = (
        "import sys, contextlib, io\n"
        "from fastdeploy.entrypoints.cli.main import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    assert main(['serve', '--print-config']) == 0\n"
        "heavy = ['uvicorn', 'fastapi', 'fastdeploy.entrypoints.openai.app',\n"
        "         'fastdeploy.entrypoints.engine_client.async_engine',\n"
        "         'fastdeploy.worker.gpu_worker']\n"
        "print([m for m in heavy if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_print_config_names_the_default_model_it_resolved(capsys):
    """Without --model, --print-config shows the bundled GGUF file that would run (not null), and
    that path given as --model resolves to the same config."""
    import json

    from fastdeploy.entrypoints.openai.api_server import run_server as run
    from fastdeploy.model_executor.model_loader.source import default_model_file

    try:
        default = str(default_model_file())
    except FileNotFoundError as e:
        pytest.skip(str(e))
    assert run(build_parser().parse_args(["serve", "--print-config"])) == 0
    config = json.loads(capsys.readouterr().out)["config"]
    assert config["model_config"]["model"] == default
    assert run(build_parser().parse_args(["serve", "--print-config", "--model", default])) == 0
    assert json.loads(capsys.readouterr().out)["config"] == config


def test_print_config_prints_the_whole_deployment_plan(capsys):
    """--print-config prints ``DeploymentPlan.to_dict()`` (it round-trips), the same dict that
    resolve_deployment gives for the same flags."""
    import json

    from fastdeploy.config import DeploymentPlan
    from fastdeploy.config.resolve import resolve_deployment
    from fastdeploy.entrypoints.openai.api_server import run_server as run

    argv = ["serve", "--print-config", "--device", "cpu", "--disable-overlap-schedule"]
    assert run(build_parser().parse_args(argv)) == 0
    printed = json.loads(capsys.readouterr().out)["deployment_plan"]
    plan = DeploymentPlan.from_dict(printed)
    assert plan.to_dict() == printed and not plan.overlap_schedule
    assert any("disable_overlap_schedule=true" in r for r in plan.reasons)
    _, resolved = resolve_deployment(EngineArgs.from_cli_args(build_parser().parse_args(argv)))
    assert resolved == plan


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--max-concurrency", "0"], "--max-concurrency=0 is invalid; allowed: an integer >= 1"),
        (["--engine-stall-timeout", "-1"], "--engine-stall-timeout=-1.0 is invalid; allowed: "),
        (["--api-server-count", "9", "--max-concurrency", "8"],
         "--api-server-count=9 is invalid; allowed: 1..--max-concurrency (8)"),
        (["--api-server-count", "2", "--disable-frontend-multiprocessing"],
         "--api-server-count=2 is invalid with --disable-frontend-multiprocessing (the API "
         "server processes share an engine process); allowed: 1"),
        (["--max-stop-strings", "100000"], "--max-stop-strings="),
    ],
)  # fmt: skip
def test_server_flag_rules_refuse_with_one_error_line(capsys, argv, message):
    """The server's own flag rules (a table, checked first): one ``error:`` line, exit 2."""
    from fastdeploy.entrypoints.openai.api_server import run_server as run

    assert run(build_parser().parse_args(["serve", "--print-config", *argv])) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1, err


def test_api_server_count_on_a_pd_node_is_one_rule_printed_and_refused(capsys):
    """``--print-config`` lists it as not supported yet; start-up refuses it with the same
    sentence (one owner: ``server_not_supported``)."""
    import json

    from fastdeploy.entrypoints.openai.api_server import run_server as run

    argv = ["serve", "--device", "cpu", "--splitwise-role", "prefill", "--api-server-count", "2"]
    assert run(build_parser().parse_args([*argv, "--print-config"])) == 0
    sentence = json.loads(capsys.readouterr().out)["not_supported_yet"]
    assert sentence.startswith("--api-server-count=2 with --splitwise-role=prefill")
    assert run(build_parser().parse_args([*argv, "--port", "0"])) == 2
    assert capsys.readouterr().err == f"error: {sentence}\n"


def test_start_up_and_the_http_layer_import_no_circle():
    """api_server -> launch -> api_workers, app: the HTTP layer is handed to start-up, which
    never imports it back (lazy imports count)."""
    import ast
    from pathlib import Path

    import fastdeploy.entrypoints as pkg

    root = Path(pkg.__file__).parent
    names = {
        "api_server": root / "openai" / "api_server.py",
        "api_workers": root / "openai" / "api_workers.py",
        "app": root / "openai" / "app.py",
        "launch": root / "launch.py",
        "server_args": root / "server_args.py",
    }
    edges = {name: set() for name in names}
    for name, path in names.items():
        for node in ast.walk(ast.parse(path.read_text())):
            modules = []
            if isinstance(node, ast.ImportFrom) and node.module:
                modules = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            for module in modules:
                edges[name] |= {other for other in names if module.endswith("." + other)}
    edges = {name: targets - {name} for name, targets in edges.items()}

    def reaches(start: str, goal: str, seen: frozenset = frozenset()) -> bool:
        return any(t == goal or (t not in seen and reaches(t, goal, seen | {t}))
                   for t in edges[start])  # fmt: skip

    assert [name for name in names if reaches(name, name)] == []
    assert "launch" in edges["api_server"] and "api_server" not in edges["launch"]
