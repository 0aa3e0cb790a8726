"""ServerMetrics is declared from one table (``fastdeploy.metrics.METRICS``)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from fastdeploy.metrics import (
    ENGINE_GAUGE_MODE,
    FINISH_REASONS,
    GRAPH_MODES,
    METRICS,
    REJECT_REASONS,
    ServerMetrics,
)


def test_every_row_is_one_attribute_and_one_series():
    assert len({spec.attr for spec in METRICS}) == len(METRICS)
    assert len({spec.name for spec in METRICS}) == len(METRICS)
    metrics = ServerMetrics()
    for spec in METRICS:
        metric = getattr(metrics, spec.attr)
        assert isinstance(metric, spec.kind)
        assert metric._name == spec.name.removesuffix("_total")
        assert metric._documentation == spec.help
        assert tuple(metric._labelnames) == spec.labels
        if spec.kind is Gauge:
            assert metric._multiprocess_mode == ENGINE_GAUGE_MODE
    kinds = {spec.kind for spec in METRICS}
    assert kinds == {Counter, Gauge, Histogram}


def test_preset_series_are_exported_at_zero():
    text = ServerMetrics().render().decode()
    for reason in FINISH_REASONS:
        assert f'fastdeploy:request_success_total{{finished_reason="{reason}"}} 0.0' in text
    for reason in REJECT_REASONS:
        assert f'fastdeploy:request_rejected_total{{reason="{reason}"}} 0.0' in text
    for mode in GRAPH_MODES:
        assert f'fastdeploy:steps_total{{mode="{mode}"}} 0.0' in text
    assert "# HELP fastdeploy:time_to_first_token_seconds Time to first token (s)." in text
    assert 'fastdeploy:time_to_first_token_seconds_bucket{le="0.001"} 0.0' in text


def test_counters_advance_by_the_engines_cumulative_counts():
    metrics = ServerMetrics()
    metrics.observe_stats({"steps_by_mode": {"eager": 3}, "num_padded_tokens": 4, "num_running": 2})
    metrics.observe_stats({"steps_by_mode": {"eager": 5}, "num_padded_tokens": 4, "num_running": 1})
    text = metrics.render().decode()
    assert 'fastdeploy:steps_total{mode="eager"} 5.0' in text
    assert "fastdeploy:padded_tokens_total 4.0" in text
    assert "fastdeploy:num_requests_running 1.0" in text


def test_the_graph_capture_progress_is_exported_as_three_gauges():
    """Issue #47: captured, planned and failed CUDA graphs from ``stats["graph_capture"]``."""
    metrics = ServerMetrics()
    progress = {"captured": 3, "total": 8, "failed": 1, "done": False}
    metrics.observe_stats({"graph_capture": progress})
    text = metrics.render().decode()
    assert "fastdeploy:cuda_graph_buckets_captured 3.0" in text
    assert "fastdeploy:cuda_graph_buckets_planned 8.0" in text
    assert "fastdeploy:cuda_graph_buckets_failed 1.0" in text
    metrics.observe_stats({"graph_capture": {**progress, "captured": 7}})
    assert "fastdeploy:cuda_graph_buckets_captured 7.0" in metrics.render().decode()
    metrics.observe_stats({"num_running": 0})  # a snapshot without it changes nothing
    assert "fastdeploy:cuda_graph_buckets_captured 7.0" in metrics.render().decode()


def test_start_up_phases_are_exported_by_phase():
    metrics = ServerMetrics()
    metrics.observe_stats(
        {
            "startup_seconds": {"imports": 2.5, "weights": 1.25},
            "graph_capture": {"captured": 1, "total": 2, "failed": 0, "background": True,
                              "seconds_by_phase": {"1": 0.5}},
        }
    )  # fmt: skip
    text = metrics.render().decode()
    assert 'fastdeploy:startup_phase_seconds{phase="imports"} 2.5' in text
    assert 'fastdeploy:startup_phase_seconds{phase="weights"} 1.25' in text
    assert 'fastdeploy:startup_phase_seconds{phase="background_capture_phase_1"} 0.5' in text
