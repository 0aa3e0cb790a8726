"""The check in ``tests/conftest.py`` can fail: a test without the ``slow`` marker that starts a
Python process fails and names it; a marked one, and a library's short-lived tool, pass."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # it runs pytest in a process of its own

SAMPLE = '''
import platform
import subprocess
import sys

import pytest


def test_starts_python_unmarked():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


@pytest.mark.slow
def test_starts_python_marked():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_a_library_probe_is_not_a_process():
    platform.architecture()  # runs `file -b` on some hosts
    subprocess.run(["uname"], check=True, capture_output=True)
'''


def test_unmarked_process_fails_and_marked_passes(tmp_path: Path):
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert "1 failed, 2 passed" in out.stdout, out.stdout[-3000:]
    assert "test_starts_python_unmarked started a process (subprocess" in out.stdout
