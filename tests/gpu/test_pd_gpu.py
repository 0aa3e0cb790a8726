"""PD disaggregation on one GPU: a prefill and a decode server as two processes
(``gpu_memory_utilization`` 0.4 each) behind ``fastdeploy router``, over ``tcp`` and, when it
imports, ``nixl``.

* Greedy output equals a mixed server's (run first, alone, with the same settings).
* The prefill node's metrics show piecewise replays and no decode graphs; the decode node's show
  full-graph replays from its first step and no eager step.
* Prints TTFT (mixed vs PD) and the KV transfer time per 1K prompt tokens.

The model is the SmolLM2 shape with dummy weights and a word-level tokenizer (no model files
travel to the GPU host).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import httpx
import pytest
from test_serve_gpu import write_tokenizer

from fastdeploy.model_executor.model_loader.presets import write_preset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "splitwise"))
from pd_cluster import Cluster, free_port  # noqa: E402

pytestmark = pytest.mark.slow  # PD nodes in processes

PROTOCOLS = ["tcp"]
try:
    import nixl  # noqa: F401

    PROTOCOLS.append("nixl")
except ImportError:
    pass

LENGTHS = (16, 1024, 4096)
MAX_TOKENS = 24


def server_argv(model_dir: str, port: int, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "fastdeploy.entrypoints.cli.main", "serve", "--model", model_dir,
        "--load-format", "dummy", "--host", "127.0.0.1", "--port", str(port),
        "--gpu-memory-utilization", "0.4", "--max-model-len", "8192", "--max-num-seqs", "16",
        "--log-level", "warning",
        # graphs before serving: the decode node's first step must replay (issue #47 serves
        # eagerly while capturing otherwise)
        "--graph-optimization-config", '{"capture_in_background": false}', *extra,
    ]  # fmt: skip


def start(cluster: Cluster, name: str, model_dir: str, *extra: str):
    port = free_port()
    return cluster.start(name, server_argv(model_dir, port, *extra), f"http://127.0.0.1:{port}")


def prompt(n: int) -> list[int]:
    return [(7919 * i) % 40000 + 5 for i in range(n)]


def ttft_and_text(url: str, n: int) -> tuple[float, str]:
    """Stream one greedy completion; returns (seconds to the first text, the whole text)."""
    body = {"prompt": prompt(n), "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "ignore_eos": True}  # fmt: skip
    t0 = time.perf_counter()
    first, text = None, ""
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            piece = event["choices"][0]["text"]
            if piece and first is None:
                first = time.perf_counter() - t0
            text += piece
    return first, text


def steps(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("fastdeploy:steps_total{"):
            out[line.split('"')[1]] = float(line.rsplit(" ", 1)[1])
    return out


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = write_preset("smollm2-135m", tmp_path_factory.mktemp("model"))
    write_tokenizer(d, 49152)
    return d


@pytest.fixture(scope="module")
def mixed_reference(model_dir, tmp_path_factory):
    """(TTFT, text) per prompt length from a mixed server (warm: each prompt runs twice, the
    second one is timed; prefix caching is off so it prefills again)."""
    with Cluster(tmp_path_factory.mktemp("mixed")) as cluster:
        mixed = start(cluster, "mixed", model_dir, "--no-enable-prefix-caching")
        cluster.wait_healthy(mixed, timeout=600)
        ref = {}
        for n in LENGTHS:
            ttft_and_text(mixed.url, n)
            ref[n] = ttft_and_text(mixed.url, n)
        return ref


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_pd_on_one_gpu(model_dir, mixed_reference, protocol, tmp_path):
    common = ["--cache-transfer-protocol", protocol, "--no-enable-prefix-caching"]
    with Cluster(tmp_path) as cluster:
        prefill = start(cluster, "prefill", model_dir, "--splitwise-role", "prefill", *common)
        decode = start(cluster, "decode", model_dir, "--splitwise-role", "decode", *common)
        cluster.wait_healthy(prefill, decode, timeout=600)
        router = cluster.start_router(["--prefill", prefill.url, "--decode", decode.url])
        cluster.wait_healthy(router)
        rows = []
        for n in LENGTHS:
            ttft_and_text(router.url, n)  # warm
            secs0 = metric(decode.url, "fastdeploy:kv_transfer_seconds_total")
            bytes0 = metric(decode.url, "fastdeploy:kv_transfer_bytes_total")
            ttft, text = ttft_and_text(router.url, n)
            secs = metric(decode.url, "fastdeploy:kv_transfer_seconds_total") - secs0
            nbytes = metric(decode.url, "fastdeploy:kv_transfer_bytes_total") - bytes0
            want_ttft, want = mixed_reference[n]
            assert text == want, f"{protocol}: {n}-token prompt differs from mixed"
            rows.append((n, want_ttft, ttft, secs, nbytes))
        p, d = steps(prefill.url), steps(decode.url)
        assert p["piecewise"] > 0 and p["full"] == 0, p
        assert d["full"] > 0 and d["eager"] == 0 and d["piecewise"] == 0, d
    print(f"\nPD on one H200 over {protocol} (SmolLM2-135M shape, bf16, dummy weights, "
          f"{MAX_TOKENS} greedy tokens); prefill steps {p}, decode steps {d}")  # fmt: skip
    print("| prompt tokens | mixed TTFT ms | PD TTFT ms | transfer ms | transfer ms / 1K tokens "
          "| MB moved | GB/s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for n, want_ttft, ttft, secs, nbytes in rows:
        gbs = nbytes / secs / 1e9 if secs else 0.0
        print(f"| {n} | {want_ttft * 1e3:.1f} | {ttft * 1e3:.1f} | {secs * 1e3:.2f} | "
              f"{secs * 1e3 / n * 1024:.2f} | {nbytes / 1e6:.1f} | {gbs:.1f} |")  # fmt: skip
