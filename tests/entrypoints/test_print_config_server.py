"""``--print-config`` prints the deployment plan that a started server runs: the same flags give
the same ``deployment_plan`` (and ``config``) in ``--print-config`` and in the running server's
``/v1/server_info``, field for field, with the engine in its own process (the plan crossed the
process line).
"""

from __future__ import annotations

import json

import httpx
import pytest
from server_process import serve

from fastdeploy.entrypoints.cli.main import build_parser
from fastdeploy.entrypoints.openai.api_server import run_server

pytestmark = pytest.mark.slow

FLAGS = ["--device", "cpu", "--max-num-seqs", "4", "--max-model-len", "512",
         "--num-gpu-blocks-override", "32", "--block-size", "16",
         "--max-num-batched-tokens", "256"]  # fmt: skip


def assert_same_fields(printed: dict, running: dict, where: str) -> None:
    """Equal dicts, compared key by key so that a failure names the field."""
    assert sorted(printed) == sorted(running), where
    for key in printed:
        if isinstance(printed[key], dict):
            assert_same_fields(printed[key], running[key], f"{where}.{key}")
        else:
            assert printed[key] == running[key], f"{where}.{key}"


def test_print_config_equals_the_running_servers_plan(tmp_path, capsys):
    try:
        from fastdeploy.model_executor.model_loader.source import default_model_file

        default_model_file()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    assert run_server(build_parser().parse_args(["serve", "--print-config", *FLAGS])) == 0
    printed = json.loads(capsys.readouterr().out)
    with serve(tmp_path, *FLAGS) as server:
        info = httpx.get(server.url + "/v1/server_info", timeout=30).json()
    assert printed["deployment_plan"]["reasons"], printed  # CPU: the overlap says what it costs
    assert_same_fields(printed["deployment_plan"], info["deployment_plan"], "deployment_plan")
    assert_same_fields(printed["config"], info["config"], "config")
