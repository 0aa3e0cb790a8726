"""vLLM's metric names: the table in ``fastdeploy.metrics.vllm_names`` and what render exports."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fastdeploy.metrics import METRICS, ServerMetrics
from fastdeploy.metrics.vllm_names import FASTDEPLOY_OF, VLLM_NAMES, VLLM_OF

#: What vLLM v0.11 declares for each name we export: type and label names (besides the
#: histogram's ``le``). Written from vLLM's ``PrometheusStatLogger``, not from our table.
VLLM_V011 = {
    "vllm:num_requests_running": ("gauge", {"model_name", "engine"}),
    "vllm:num_requests_waiting": ("gauge", {"model_name", "engine"}),
    "vllm:kv_cache_usage_perc": ("gauge", {"model_name", "engine"}),
    # vLLM labels it with every CacheConfig field; we export three of those fields.
    "vllm:cache_config_info": (
        "gauge",
        {"engine", "block_size", "num_gpu_blocks", "num_cpu_blocks"},
    ),
    "vllm:lora_requests_info": (
        "gauge",
        {"engine", "max_lora", "running_lora_adapters", "waiting_lora_adapters"},
    ),
    "vllm:time_to_first_token_seconds": ("histogram", {"model_name", "engine"}),
    "vllm:time_per_output_token_seconds": ("histogram", {"model_name", "engine"}),
    "vllm:inter_token_latency_seconds": ("histogram", {"model_name", "engine"}),
    "vllm:e2e_request_latency_seconds": ("histogram", {"model_name", "engine"}),
    "vllm:prompt_tokens": ("counter", {"model_name", "engine"}),
    "vllm:generation_tokens": ("counter", {"model_name", "engine"}),
    "vllm:request_success": ("counter", {"model_name", "engine", "finished_reason"}),
    "vllm:prefix_cache_queries": ("counter", {"model_name", "engine"}),
    "vllm:prefix_cache_hits": ("counter", {"model_name", "engine"}),
    "vllm:num_preemptions": ("counter", {"model_name", "engine"}),
}
#: The series llm-d's endpoint picker scrapes from a vLLM-labelled model server.
LLMD_SERIES = (
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
    "vllm:cache_config_info",
    "vllm:lora_requests_info",
)


def families(metrics: ServerMetrics) -> dict:
    return {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}


def busy_metrics() -> ServerMetrics:
    """A ServerMetrics after known stats and requests (two snapshots, so counters advance)."""
    metrics = ServerMetrics(model_name="smol")
    base = {"block_size": 64, "num_gpu_blocks": 129, "num_running": 3, "num_waiting": 2}
    metrics.observe_stats(
        {
            **base,
            "kv_cache_usage": 0.5,
            "prefix_cache_queries": 200,
            "prefix_cache_hits": 64,
            "num_preemptions": 1,
        }
    )
    metrics.observe_stats(
        {
            **base,
            "kv_cache_usage": 0.75,
            "prefix_cache_queries": 300,
            "prefix_cache_hits": 128,
            "num_preemptions": 2,
        }
    )
    metrics.observe_first_token(0.07, 21)
    metrics.observe_tokens(4, 0.08)
    metrics.observe_finish("length", 0.4)
    return metrics


def test_the_table_maps_both_ways_and_covers_what_the_issue_names():
    assert set(FASTDEPLOY_OF) == set(VLLM_V011)
    assert len({row.vllm for row in VLLM_NAMES}) == len(VLLM_NAMES)
    ours = {spec.name for spec in METRICS}
    for row in VLLM_NAMES:
        assert row.fastdeploy in ours, row
        assert row.vllm in VLLM_OF[row.fastdeploy]
        assert FASTDEPLOY_OF[row.vllm] == row.fastdeploy
    assert set(LLMD_SERIES) <= set(FASTDEPLOY_OF)


def test_every_vllm_name_is_exported_with_vllms_type_and_labels():
    got = families(busy_metrics())
    for name, (kind, labels) in VLLM_V011.items():
        family = got[name]
        assert family.type == kind, name
        for sample in family.samples:
            assert set(sample.labels) - {"le"} == labels, (name, sample)


def test_each_pair_carries_the_same_values():
    got = families(busy_metrics())
    for row in VLLM_NAMES:
        ours, theirs = got[row.fastdeploy], got[row.vllm]
        extra = {"model_name", "engine"} if row.server_labels else {"engine"}
        strip = [
            (
                s.name[len(row.vllm) :],
                {k: v for k, v in s.labels.items() if k not in extra},
                s.value,
            )
            for s in theirs.samples
            if not s.name.endswith("_created")
        ]
        mine = [
            (s.name[len(row.fastdeploy) :], s.labels, s.value)
            for s in ours.samples
            if not s.name.endswith("_created")
        ]
        assert strip == mine, row
        assert all(s.labels["engine"] == "0" for s in theirs.samples)
        if row.server_labels:
            assert all(s.labels["model_name"] == "smol" for s in theirs.samples)


def value(got: dict, name: str, sample: str | None = None, **labels) -> float:
    for s in got[name].samples:
        if s.name == (sample or name) and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise KeyError((name, sample, labels))


def test_values_are_the_engines_numbers():
    got = families(busy_metrics())
    assert value(got, "vllm:num_requests_running") == 3
    assert value(got, "vllm:num_requests_waiting") == 2
    assert value(got, "vllm:kv_cache_usage_perc") == 0.75
    assert value(got, "vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total") == 300
    assert value(got, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total") == 128
    assert value(got, "vllm:num_preemptions", "vllm:num_preemptions_total") == 2
    assert value(got, "vllm:prompt_tokens", "vllm:prompt_tokens_total") == 21
    assert value(got, "vllm:generation_tokens", "vllm:generation_tokens_total") == 4
    assert (
        value(got, "vllm:request_success", "vllm:request_success_total", finished_reason="length")
        == 1
    )
    assert (
        value(got, "vllm:inter_token_latency_seconds", "vllm:inter_token_latency_seconds_count")
        == 4
    )
    info = [s for s in got["vllm:cache_config_info"].samples]
    assert [(s.labels["block_size"], s.labels["num_gpu_blocks"], s.value) for s in info] == [
        ("64", "129", 1.0)
    ]
    (lora,) = got["vllm:lora_requests_info"].samples
    assert (lora.labels["max_lora"], lora.labels["running_lora_adapters"]) == ("0", "")
    assert lora.value > 1.7e9  # a timestamp, as vLLM's


def test_histogram_buckets_are_the_same_ladder():
    got = families(busy_metrics())
    for row in VLLM_NAMES:
        if got[row.vllm].type != "histogram":
            continue
        bounds = [s.labels["le"] for s in got[row.vllm].samples if s.name.endswith("_bucket")]
        ours = [s.labels["le"] for s in got[row.fastdeploy].samples if s.name.endswith("_bucket")]
        assert bounds == ours and len(bounds) > 10


def test_a_changed_pool_replaces_the_cache_config_series():
    metrics = ServerMetrics()
    metrics.observe_stats({"block_size": 16, "num_gpu_blocks": 10})
    metrics.observe_stats({"block_size": 16, "num_gpu_blocks": 12, "num_host_blocks": 4})
    info = families(metrics)["vllm:cache_config_info"].samples
    assert [(s.labels["num_gpu_blocks"], s.labels["num_cpu_blocks"]) for s in info] == [("12", "4")]


@pytest.mark.slow  # starts processes
@pytest.mark.parametrize("processes", [2])
def test_multiprocess_render_exports_vllm_names_once(tmp_path, processes):
    """Several API server processes: the copies come from the combined values (counters
    summed over processes), once each."""
    script = textwrap.dedent(
        f"""
        import sys
        from fastdeploy.metrics import ServerMetrics
        index = int(sys.argv[1])
        m = ServerMetrics(multiprocess_dir={str(tmp_path)!r}, engine_stats=index == 0,
                          model_name="smol")
        m.observe_stats({{"num_running": 5, "block_size": 64, "num_gpu_blocks": 33}})
        m.observe_first_token(0.1, 10 + index)
        if index == {processes - 1}:
            sys.stdout.write(m.render().decode())
        """
    )
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    out = ""
    for index in range(processes):
        out = subprocess.run(
            [sys.executable, "-c", script, str(index)],
            env=env,
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
    got = {f.name: f for f in text_string_to_metric_families(out)}
    assert value(got, "vllm:prompt_tokens", "vllm:prompt_tokens_total") == 21
    assert value(got, "vllm:num_requests_running") == 5
    assert out.count("# HELP vllm:prompt_tokens") == 1
    info = got["vllm:cache_config_info"].samples
    assert [s.labels["num_gpu_blocks"] for s in info] == ["33"]
