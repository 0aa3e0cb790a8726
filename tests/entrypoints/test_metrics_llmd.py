"""The series llm-d's endpoint picker scrapes, from ``fastdeploy serve`` with the default model,
moving as the load does.

The test scrapes ``/metrics`` when idle, while more streams are in flight than
``--max-num-seqs`` admits, and after they finish. Running and waiting requests and KV usage
rise, then fall back to 0. The token counters grow by exactly the tokens served, and a repeated
prompt adds prefix-cache hits. Each ``vllm:`` name equals its ``fastdeploy:`` twin.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from http_server_utils import wait_until
from prometheus_client.parser import text_string_to_metric_families
from server_process import serve, wait_all_blocks_free

pytestmark = pytest.mark.slow

MODEL = "smol"
MAX_NUM_SEQS = 2
STREAMS = 5
MAX_TOKENS = 48
BLOCK = 16


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """``{(sample name, sorted labels without engine/model_name): value}`` of ``/metrics``."""
    text = httpx.get(url + "/metrics", timeout=30).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(
                sorted((k, v) for k, v in s.labels.items() if k not in ("engine", "model_name"))
            )
            out[(s.name, labels)] = s.value
    return out


def get(samples: dict, name: str, **labels) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serve(
        tmp_path_factory.mktemp("llmd"),
        "--served-model-name",
        MODEL,
        "--max-num-seqs",
        str(MAX_NUM_SEQS),
        "--block-size",
        str(BLOCK),
        "--max-model-len",
        "1024",
        "--seed",
        "0",
    ) as proc:
        yield proc


def stream_completion(url: str, prompt: str, usages: list) -> None:
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usages.append(chunk["usage"])


def test_llmd_series_move_with_the_load(server):
    url = server.url
    idle = scrape(url)
    text = httpx.get(url + "/metrics", timeout=30).text
    assert f'model_name="{MODEL}"' in text
    for name in (
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
    ):
        assert get(idle, name) == 0, name
    (info,) = [k for k in idle if k[0] == "vllm:cache_config_info"]
    labels = dict(info[1])
    assert labels["block_size"] == str(BLOCK) and int(labels["num_gpu_blocks"]) > 1
    assert idle[info] == 1
    (lora,) = [k for k in idle if k[0] == "vllm:lora_requests_info"]
    assert dict(lora[1])["max_lora"] == "0" and idle[lora] > 1.7e9

    usages: list = []
    threads = [
        threading.Thread(
            target=stream_completion, args=(url, f"Story {i}: once upon a time,", usages)
        )
        for i in range(STREAMS)
    ]
    for t in threads:
        t.start()
    peak = {"running": 0.0, "waiting": 0.0, "usage": 0.0}

    def loaded() -> bool:
        s = scrape(url)
        peak["running"] = max(peak["running"], get(s, "vllm:num_requests_running"))
        peak["waiting"] = max(peak["waiting"], get(s, "vllm:num_requests_waiting"))
        peak["usage"] = max(peak["usage"], get(s, "vllm:kv_cache_usage_perc"))
        return peak["running"] == MAX_NUM_SEQS and peak["waiting"] > 0 and peak["usage"] > 0

    try:
        wait_until(loaded, 120, "running == max-num-seqs, waiting > 0 and KV usage > 0")
    finally:
        for t in threads:
            t.join(300)
    assert len(usages) == STREAMS
    assert peak["running"] <= MAX_NUM_SEQS and 0 < peak["usage"] <= 1

    wait_all_blocks_free(url)
    after = scrape(url)
    # The gauges come from the engine's last snapshot, a step or two behind.
    wait_until(lambda: get(scrape(url), "vllm:num_requests_running") == 0, 30, "running 0")
    after = scrape(url)
    assert get(after, "vllm:num_requests_waiting") == 0
    assert get(after, "vllm:kv_cache_usage_perc") < peak["usage"]
    prompt = sum(u["prompt_tokens"] for u in usages)
    completion = sum(u["completion_tokens"] for u in usages)
    assert completion == STREAMS * MAX_TOKENS
    for name, served in (("prompt_tokens", prompt), ("generation_tokens", completion)):
        grew = get(after, f"vllm:{name}_total") - get(idle, f"vllm:{name}_total")
        assert grew == served, name
        assert get(after, f"fastdeploy:{name}_total") == get(after, f"vllm:{name}_total")
    assert (
        get(after, "vllm:request_success_total", finished_reason="length")
        - get(idle, "vllm:request_success_total", finished_reason="length")
        == STREAMS
    )
    assert get(after, "vllm:time_to_first_token_seconds_count") >= STREAMS


def test_a_repeated_prompt_adds_prefix_cache_hits(server):
    url = server.url
    prompt = "The history of the printing press, told in short chapters. " * 6
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    before = scrape(url)
    first = httpx.post(url + "/v1/completions", json=body, timeout=120).json()["usage"]
    second = httpx.post(url + "/v1/completions", json=body, timeout=120).json()["usage"]
    assert second["prompt_tokens_details"]["cached_tokens"] >= BLOCK
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in (first, second))

    def counted() -> bool:
        s = scrape(url)
        return (
            get(s, "vllm:prefix_cache_hits_total") - get(before, "vllm:prefix_cache_hits_total")
            == cached
        )

    deadline = time.monotonic() + 30
    while not counted():
        assert time.monotonic() < deadline, "prefix cache hits did not reach the cached tokens"
        time.sleep(0.2)
    after = scrape(url)
    queried = get(after, "vllm:prefix_cache_queries_total") - get(
        before, "vllm:prefix_cache_queries_total"
    )
    assert queried == first["prompt_tokens"] + second["prompt_tokens"]
    assert get(after, "fastdeploy:prefix_cache_hits_total") == get(
        after, "vllm:prefix_cache_hits_total"
    )
