"""``fastdeploy serve`` on the GPU with graphs on: chat completions are served and both graph
kinds replay (the /metrics step counters show it).

The model is the SmolLM2 shape with dummy weights; a small word-level tokenizer with a chat template
is built here with the ``tokenizers`` library (no model files travel to the GPU host).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fastdeploy.model_executor.model_loader.presets import write_preset

pytestmark = pytest.mark.slow  # fastdeploy serve in a process

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)


def write_tokenizer(directory, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials)}
    vocab.update({f"w{i}": i for i in range(len(specials), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        eos_token="<|im_end|>",
        bos_token="<|im_start|>",
        additional_special_tokens=specials[1:],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)


def test_serve_chat_with_full_and_piecewise_graphs(tmp_path):
    model_dir = write_preset("smollm2-135m", tmp_path / "model")
    write_tokenizer(model_dir, 49152)
    port = 18000 + int(time.time()) % 1000
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "fastdeploy.entrypoints.cli.main", "serve", "--model", model_dir,
           "--load-format", "dummy", "--host", "127.0.0.1", "--port", str(port),
           "--graph-optimization-config", '{"use_cudagraph": true, "full_cuda_graph": false}',
           "--max-num-seqs", "8", "--max-model-len", "1024", "--max-num-batched-tokens", "256",
           "--num-gpu-blocks-override", "256"]  # fmt: skip
    log = open(tmp_path / "server.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            raise AssertionError("server did not become healthy in 240 s")
        info = httpx.get(url + "/v1/server_info", timeout=10).json()
        plan = info["deployment_plan"]["graph"]
        assert plan["decode_graphs"] and plan["prefill_graphs"], plan
        # Ready before the graphs are captured (issue #47): wait for them, so that the steps
        # below replay graphs.
        while not info["stats"]["graph_capture"]["done"]:
            assert time.monotonic() < deadline, info["stats"]["graph_capture"]
            time.sleep(0.2)
            info = httpx.get(url + "/v1/server_info", timeout=10).json()
        assert info["stats"]["graph_capture"]["failed"] == 0, info["stats"]["graph_capture"]
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        body = {
            "model": model,
            "max_tokens": 24,
            "temperature": 0,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": "w5 w6 w7 " * 20}],
        }
        replies = []
        for stream in (False, True):
            r = httpx.post(
                url + "/v1/chat/completions", json={**body, "stream": stream}, timeout=60
            )
            assert r.status_code == 200, r.text
            if stream:
                chunks = [
                    json.loads(line[6:])
                    for line in r.text.splitlines()
                    if line.startswith("data: ") and line != "data: [DONE]"
                ]
                replies.append(
                    "".join(
                        c["choices"][0]["delta"].get("content") or ""
                        for c in chunks
                        if c["choices"]
                    )
                )
            else:
                replies.append(r.json()["choices"][0]["message"]["content"])
        assert replies[0] == replies[1] and replies[0]
        metrics = httpx.get(url + "/metrics", timeout=10).text
        steps = {}
        for family in text_string_to_metric_families(metrics):
            if family.name == "fastdeploy:steps":
                for sample in family.samples:
                    if sample.name.endswith("_total"):
                        steps[sample.labels["mode"]] = sample.value
        print("steps by mode after two chat completions:", steps)
        assert steps.get("full", 0) > 0 and steps.get("piecewise", 0) > 0, steps
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    assert proc.returncode == 0, (tmp_path / "server.log").read_text()[-3000:]
