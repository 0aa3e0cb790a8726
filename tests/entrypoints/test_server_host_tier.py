"""The server with a host KV tier (``--swap-space``) in front of a tiny random-weight Llama and a
small device pool: a prompt that the device pool lost comes back from the host, and ``/metrics``
and ``/v1/server_info`` report the hits, the bytes swapped in and stored, and the host usage. The
engine loop keeps stepping until the last stores landed, with no request in flight."""

from __future__ import annotations

import json

import httpx
import pytest
from http_server_utils import get_json, metric_samples, serve_in_thread, wait_until
from tiny_models import tiny_llama

from fastdeploy.engine.args_utils import EngineArgs
from fastdeploy.engine.engine import LLMEngine

MODEL = "tiny-host-tier"
TINY = tiny_llama(tie_word_embeddings=False)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_host_tier")
    (d / "config.json").write_text(json.dumps(TINY))
    args = EngineArgs(
        model=str(d), load_format="dummy", skip_tokenizer_init=True, device="cpu",
        max_model_len=256, block_size=16, num_gpu_blocks_override=10, max_num_seqs=4,
        swap_space=0.001, seed=0,
    )  # fmt: skip
    engine = LLMEngine.from_engine_args(args)
    with serve_in_thread(engine, MODEL) as (url, _):
        yield url, engine
    engine.shutdown()


def complete(url: str, prompt: list[int]) -> list[int]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_host_hits_show_in_metrics_and_server_info(server):
    url, engine = server
    a = [(i * 37) % 500 + 5 for i in range(100)]
    b = [(i * 53) % 500 + 7 for i in range(120)]
    first = complete(url, a)
    complete(url, b)  # 9 usable blocks: a's blocks leave the device
    assert complete(url, a) == first
    samples = metric_samples(url)
    assert samples[("fastdeploy:host_cache_hit_tokens_total", ())] > 0
    assert samples[("fastdeploy:swap_in_bytes_total", ())] > 0
    assert samples[("fastdeploy:host_store_bytes_total", ())] > 0
    assert 0 < samples[("fastdeploy:host_cache_usage_perc", ())] <= 1
    stats = get_json(url, "/v1/server_info")["stats"]
    assert stats["host_cache_hit_tokens"] >= 16 * 5 and stats["swap_in_bytes"] > 0
    assert stats["num_host_blocks"] > 0

    # With nothing in flight, the loop still steps until the last stores landed.
    def settled():
        stats = get_json(url, "/v1/server_info")["stats"]
        return stats["host_pending_stores"] == 0 and not engine.has_background_work()

    wait_until(settled, 10, "the host tier's last stores")
    assert get_json(url, "/v1/server_info")["stats"]["num_waiting_for_swap_in"] == 0
