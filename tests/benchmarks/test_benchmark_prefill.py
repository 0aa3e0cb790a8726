"""benchmarks/benchmark_prefill.py pieces that run without a GPU: which profiler events count as
kernels, and that every timed mode also takes another measure (the kernel counter) and leaves
the runner's graphs as it found them."""

from __future__ import annotations

import json
from pathlib import Path

from support import load_benchmark_module
from tiny_models import tiny_llama
from torch.autograd import DeviceType

from fastdeploy.engine.args_utils import EngineArgs
from fastdeploy.engine.engine import LLMEngine

ROOT = Path(__file__).resolve().parents[2]

TINY = tiny_llama()


def load_benchmark():
    return load_benchmark_module("benchmark_prefill")


class Event:
    """A kineto event as the profiler returns it; ``kind=None``: a torch without activity_type."""

    def __init__(self, device, name, kind=None):
        self._device, self._name = device, name
        if kind is not None:
            self.activity_type = lambda: kind

    def device_type(self):
        return self._device

    def name(self):
        return self._name


def test_only_device_kernels_count():
    bench = load_benchmark()
    cuda = DeviceType.CUDA
    assert bench.is_kernel(Event(cuda, "ampere_bf16_gemm", "kernel"))
    assert not bench.is_kernel(Event(cuda, "Memcpy HtoD (Pinned -> Device)", "gpu_memcpy"))
    assert not bench.is_kernel(Event(cuda, "Memset (Device)", "gpu_memset"))
    assert not bench.is_kernel(Event(DeviceType.CPU, "cudaLaunchKernel", "cuda_runtime"))
    assert bench.is_kernel(Event(cuda, "flashinfer::BatchDecode"))  # by name on older torch
    assert not bench.is_kernel(Event(cuda, "Memcpy DtoD (Device -> Device)"))


def test_modes_take_a_measure_and_restore_graphs(tmp_path):
    bench_mod = load_benchmark()
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    engine = LLMEngine.from_engine_args(
        EngineArgs(model=str(tmp_path), load_format="dummy", device="cpu", dtype="float32",
                   skip_tokenizer_init=True, max_model_len=128, block_size=16, max_num_seqs=4)
    )  # fmt: skip
    try:
        bench = bench_mod.Bench(engine, iters=1, warmup=0)
        seen = []

        def measure(fn):
            seen.append(bench.runner.graph_runner)
            fn()
            return 7

        assert bench.eager(8, measure) == 7
        assert bench.decode(2, 16, graphs=False, measure=measure) == 7
        assert bench.decode(2, 16, graphs=True, measure=measure) == 7
        assert bench.piecewise(8, measure) is None  # CPU: no graphs to replay
        assert seen == [None, None, bench.graphs]
        assert bench.runner.graph_runner is bench.graphs
    finally:
        engine.shutdown()


def test_engine_holds_the_decode_context_when_every_prompt_is_shorter(tmp_path, monkeypatch):
    """``--tokens 16 64 --decode-context 512`` once failed its decode rows: max_model_len came
    from the prompts alone (65 tokens, 2 blocks of 64) and a 512-token decode request needs 8."""
    bench_mod = load_benchmark()
    built = []

    class Built:  # what build_engine calls on the engine it built
        def finish_graph_capture(self):
            pass

    monkeypatch.setattr(
        bench_mod.LLMEngine,
        "from_engine_args",
        classmethod(lambda cls, a: built.append(a) or Built()),
    )
    args = bench_mod.argparse.Namespace(
        graph_opt_level=0, capture_sizes="tokens", dtype="float32", max_num_seqs=4,
        attention_backend=None, decode_context=512,
    )  # fmt: skip
    bench_mod.build_engine(args, str(tmp_path), [16, 64])
    bench_mod.build_engine(args, str(tmp_path), [16, 1024])
    bench_mod.build_engine(args, str(tmp_path), [16, 8192])
    assert [a.max_model_len for a in built] == [513, 1025, 8192]
