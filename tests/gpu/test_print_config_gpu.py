"""``--print-config --device cuda`` and a running CUDA engine report the same config and
deployment plan.

The plan is resolved once (``resolve_deployment``), from a config whose device and attention
backend were decided before the policy ran; the worker never edits it. So what ``--print-config``
prints (without loading weights) is what the engine captures and dispatches with.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from gpu_utils import make_llm, preset_dir

pytestmark = pytest.mark.slow  # fastdeploy serve --print-config in a process

ENGINE = {
    "max_num_seqs": 8,
    "max_model_len": 1024,
    "max_num_batched_tokens": 256,
    "num_gpu_blocks_override": 64,
}


def test_print_config_equals_the_running_engine(tmp_path_factory):
    model_dir = preset_dir(tmp_path_factory, "smollm2-135m")
    flags = ["--model", model_dir, "--load-format", "dummy", "--dtype", "bfloat16"]
    flags += ["--device", "cuda", "--seed", "0", "--skip-tokenizer-init"]
    for key, value in ENGINE.items():
        flags += ["--" + key.replace("_", "-"), str(value)]
    printed = subprocess.run(
        [sys.executable, "-m", "fastdeploy.entrypoints.openai.api_server", "--print-config"]
        + flags,
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    ).stdout
    printed = json.loads(printed)
    llm = make_llm(model_dir, **ENGINE)
    try:
        engine = llm.engine
        running = engine.describe()
        print("printed plan:", printed["deployment_plan"])
        print("running plan:", running["deployment_plan"])
        assert printed["deployment_plan"] == running["deployment_plan"]
        assert printed["config"] == running["config"]
        assert printed["config"]["device_config"] == {
            "device": "cuda",
            "attention_backend": engine.worker.runner.attn_backend.name,
        }
        # The running engine captured exactly the printed buckets.
        graphs = engine.worker.runner.graph_runner
        plan = printed["deployment_plan"]["graph"]
        assert sorted(graphs.full, reverse=True) == plan["decode_capture_sizes"]
        assert sorted(graphs.piecewise, reverse=True) == plan["prefill_capture_sizes"]
    finally:
        llm.engine.shutdown()
