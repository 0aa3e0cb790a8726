"""benchmarks/benchmark_kernels.py pieces that run without a GPU: the projection shapes it
times, and that every shape it times by default has a row in the tiling table (or is left to
cuBLAS on purpose)."""

from __future__ import annotations

import pytest
from support import load_benchmark_module

from custom_ops.skinny_gemm import pick_config


def test_shapes_of_the_presets():
    bench = load_benchmark_module("benchmark_kernels")
    assert bench.shapes_of("smollm2-135m") == {
        "qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
        "lm_head": (49152, 576),
    }  # fmt: skip
    assert bench.shapes_of("llama3-8b") == {
        "qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
        "down": (4096, 14336), "lm_head": (128256, 4096),
    }  # fmt: skip
    with pytest.raises(KeyError, match="unknown preset 'nope'"):
        bench.shapes_of("nope")


def test_tiling_table_on_the_measured_shapes():
    # The fastest tiling of the H200 sweep per shape (see pick_config's docstring).
    assert pick_config(960, 576) == (16, 128, 4, 3)
    assert pick_config(576, 1536) == (16, 256, 4, 4)
    assert pick_config(3072, 576) == (32, 128, 4, 3)
    assert pick_config(49152, 576) is None  # cuBLAS was faster
    assert pick_config(4096, 4096) == (32, 128, 4, 4)
    assert pick_config(6144, 4096) == (64, 512, 4, 3)
    assert pick_config(28672, 4096) == (32, 128, 4, 3)
    assert pick_config(4096, 14336) == (32, 512, 4, 4)
    assert pick_config(128256, 4096) == (64, 128, 4, 4)
