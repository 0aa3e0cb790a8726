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
