"""check_http_stack: the server names uvloop/httptools when uvicorn would run without them."""

from __future__ import annotations

import importlib.util
import logging

import pytest

from fastdeploy.entrypoints.openai.app import check_http_stack


def test_installed_stack_needs_no_warning(caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("uvloop")
    pytest.importorskip("httptools")
    with caplog.at_level(logging.WARNING):
        assert check_http_stack() == []
    assert "not installed" not in caplog.text


@pytest.mark.parametrize("hidden", [("uvloop",), ("httptools",), ("uvloop", "httptools")])
def test_a_missing_part_is_named_with_its_fallback_and_fix(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, hidden: tuple[str, ...]
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in hidden else real(name, *a)
    )
    with caplog.at_level(logging.WARNING):
        missing = check_http_stack()
    assert missing == list(hidden)
    assert f"pip install {' '.join(hidden)}" in caplog.text
    if "uvloop" in hidden:
        assert "asyncio's event loop" in caplog.text
    if "httptools" in hidden:
        assert "h11" in caplog.text
