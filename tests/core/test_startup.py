"""Start-up phase timing (fastdeploy.core.startup)."""

from __future__ import annotations

import time

import pytest

from fastdeploy.core.startup import StartupPhases, process_age_seconds


def test_phases_are_timed_in_order_and_added_up():
    phases = StartupPhases({"imports": 1.23456, "skipped": None})
    with phases.phase("weights"):
        time.sleep(0.02)
    with pytest.raises(ValueError), phases.phase("kv"):
        raise ValueError("recorded anyway")
    phases.add("weights", 1.0)
    assert list(phases.seconds) == ["imports", "weights", "kv"]
    assert phases.seconds["imports"] == 1.235
    assert 1.02 <= phases.seconds["weights"] < 1.5
    assert phases.describe().startswith("imports 1.24 s, weights ")


def test_the_process_age_is_positive_and_grows():
    first = process_age_seconds()
    assert first is not None and first > 0
    time.sleep(0.05)
    assert process_age_seconds() >= first


def test_the_warm_up_line_names_flashinfers_cache_only_when_flashinfer_is_loaded(monkeypatch):
    import sys
    import types

    from fastdeploy.worker.gpu_worker import flashinfer_cache_note

    monkeypatch.delitem(sys.modules, "flashinfer", raising=False)
    assert flashinfer_cache_note() == ""  # torch-native attention, or CPU: nothing to say
    env = types.ModuleType("flashinfer.jit.env")
    env.FLASHINFER_CACHE_DIR = "/cache/.cache/flashinfer"
    for name, module in {
        "flashinfer": types.ModuleType("flashinfer"),
        "flashinfer.jit": types.ModuleType("flashinfer.jit"),
        "flashinfer.jit.env": env,
    }.items():
        monkeypatch.setitem(sys.modules, name, module)
    note = flashinfer_cache_note()
    assert "/cache/.cache/flashinfer" in note and "FLASHINFER_WORKSPACE_BASE" in note
