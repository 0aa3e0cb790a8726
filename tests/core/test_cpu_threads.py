"""The thread settings of a process that runs engine steps (fastdeploy.core.cpu_threads): the
server's engine process and the offline LLM (the engine in the caller's process) run with the
same ones, OMP_WAIT_POLICY=PASSIVE unless the user set it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import asdict

import pytest
from tiny_models import tiny_llama

from fastdeploy.config.resolve import resolve_deployment
from fastdeploy.core import cpu_threads
from fastdeploy.engine.args_utils import EngineArgs
from fastdeploy.entrypoints.engine_client.process_client import EngineCoreProcess

ENGINE = dict(
    load_format="dummy", skip_tokenizer_init=True, max_model_len=128, block_size=16,
    max_num_seqs=2, seed=0, device="cpu",
)  # fmt: skip


def test_the_engine_env_is_passive_unless_the_user_set_a_policy():
    assert cpu_threads.engine_thread_env({}) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert cpu_threads.engine_thread_env({"OMP_WAIT_POLICY": "ACTIVE"}) == {}


@pytest.mark.slow
def test_importing_fastdeploy_sets_the_policy_before_torch_loads():
    code = textwrap.dedent(
        """
        import os, sys
        import fastdeploy
        assert "torch" not in sys.modules
        from fastdeploy.core.cpu_threads import thread_settings
        print(os.environ["OMP_WAIT_POLICY"], thread_settings().omp_wait_policy)
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["PASSIVE", "PASSIVE"]


@pytest.mark.slow
def test_the_llm_and_the_servers_engine_process_use_the_same_settings(tmp_path):
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(tiny_llama(num_hidden_layers=1)))
    # The offline path as a user runs it: a fresh interpreter, the engine in it.
    code = textwrap.dedent(
        f"""
        import json
        from dataclasses import asdict
        from fastdeploy import LLM
        llm = LLM({str(model)!r}, **{ENGINE!r})
        print(json.dumps(asdict(llm.thread_settings)))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    offline = json.loads(out.stdout.strip().splitlines()[-1])
    # The server's path: the engine process that EngineCoreProcess spawns.
    config, plan = resolve_deployment(EngineArgs(model=str(model), **ENGINE))
    core = EngineCoreProcess(config, plan, log_level="warning")
    try:
        served = asdict(core.engine_threads)
    finally:
        core.kill()
    assert offline == served
    assert served["omp_wait_policy"] == os.environ.get("OMP_WAIT_POLICY", "PASSIVE")
