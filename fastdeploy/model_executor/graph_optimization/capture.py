"""The capture session before serving (garbage collection frozen, time and memory logged, errors
that name the knobs), and the one-graph session of the background capture (:func:`gap_capture`).
The capture loops themselves are the model runner's
(``GPUModelRunner.capture_model_prefill_and_mixed`` and ``GPUModelRunner.capture_model``)."""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Iterator

import torch
from tqdm.auto import tqdm

from fastdeploy.model_executor.graph_optimization.graph_runner import CudaGraphRunner

logger = logging.getLogger(__name__)

KNOBS = (
    "max_num_seqs, cudagraph_capture_sizes / cudagraph_capture_sizes_prefill, "
    "gpu_memory_utilization, or use_cudagraph=false"
)


@contextlib.contextmanager
def frozen_gc() -> Iterator[None]:
    """Collect once, then keep the garbage collector out of the capture (it otherwise dominates
    capture time)."""
    gc.collect()
    gc.freeze()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
        gc.unfreeze()


@contextlib.contextmanager
def gap_capture(cuda: bool) -> Iterator[None]:
    """The window of one graph's capture between two served steps: on CUDA, wait for the step
    in flight first (the capture and its eager warm-up runs then have the device and the
    runner's persistent buffers to themselves), and again at the end (what follows sees the
    graph complete); inference mode on; the garbage collector disabled but not run (a full
    collection of a serving engine's heap would cost more than the capture; the start-up heap is
    frozen already)."""
    if cuda:
        torch.cuda.synchronize()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.inference_mode():
            yield
        if cuda:
            torch.cuda.synchronize()
    finally:
        if was_enabled:
            gc.enable()


@contextlib.contextmanager
def capture_session(graphs: CudaGraphRunner) -> Iterator[tqdm]:
    """The window in which ``graphs`` may capture: yields a progress bar over every bucket of the
    plan (update it once per captured bucket).

    Inside: the capture window is open, GC frozen, inference mode on. On exit the window closes
    for good, and the time, graph count and graph memory (what the graphs' private pool keeps
    reserved) are stored on ``graphs`` and logged.

    Raises:
        RuntimeError: out of memory or a CUDA error during capture (the graphs are released),
            naming the knobs to turn.
    """
    plan = graphs.plan
    total = len(plan.prefill_capture_sizes) + len(plan.decode_capture_sizes)
    if graphs.graph_opt_level > 0 and plan.prefill_graphs:
        logger.info(
            "graph_opt_level=%d: compiling the segments of %d prefill buckets with torch.compile "
            "before capture; expect tens of seconds per bucket at level 1 and minutes at level 2 "
            "(max-autotune)",
            graphs.graph_opt_level,
            len(plan.prefill_capture_sizes),
        )
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    reserved_before = torch.cuda.memory_reserved()
    start = time.perf_counter()
    graphs.begin_capture()
    try:
        with (
            frozen_gc(),
            torch.inference_mode(),
            tqdm(total=total, desc="Capturing CUDA graphs") as bar,
        ):
            yield bar
    except (torch.OutOfMemoryError, RuntimeError) as e:
        graphs.release()
        raise RuntimeError(
            f"CUDA graph capture failed ({type(e).__name__}: {e}); lower the memory it needs "
            f"with {KNOBS}"
        ) from e
    finally:
        graphs.end_capture()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    # Warm-up activations went to the shared allocator cache; what stays reserved after emptying
    # it is held by the graphs' private pool.
    torch.cuda.empty_cache()
    used = torch.cuda.memory_reserved() - reserved_before
    graphs.capture_seconds = elapsed
    graphs.memory_bytes = used
    logger.info(
        "captured %d CUDA graphs (%d prefill buckets, %d decode buckets, %d sampled-row "
        "buckets) in %.2f s, graph memory %.1f MiB",
        graphs.num_graphs(),
        len(graphs.piecewise),
        len(graphs.full),
        len(graphs.sampled),
        elapsed,
        used / 2**20,
    )
    logger.info("capture time by phase: %s", {k: round(v, 2) for k, v in graphs.seconds.items()})
