"""Warm-up capture of every bucket: largest first, one pool, GC frozen, time and memory logged."""

from __future__ import annotations

import contextlib
import gc
import logging
import time

import torch
from tqdm.auto import tqdm

from fastdeploy.core.scheduler_output import ScheduledRequest, SchedulerOutput
from fastdeploy.model_executor.graph_optimization.graph_runner import CudaGraphRunner, split_tokens

logger = logging.getLogger(__name__)

KNOBS = (
    "max_num_seqs, cudagraph_capture_sizes / cudagraph_capture_sizes_prefill, "
    "gpu_memory_utilization, or use_cudagraph=false"
)


@contextlib.contextmanager
def frozen_gc():
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


def _dummy(sizes: list[int], history: int, block_size: int, share_block: bool) -> SchedulerOutput:
    """A dummy step: one request per entry of ``sizes`` new tokens after ``history`` cached ones.
    Block 0 is the reserved null block, so blocks start at 1; with ``share_block`` every request
    uses block 1 (decode capture: values written there are garbage and never read as real KV)."""
    from fastdeploy.core.request import Request
    from fastdeploy.core.sampling_params import SamplingParams

    sched = SchedulerOutput()
    block = 1
    for i, n in enumerate(sizes):
        total = history + n
        nblocks = -(-total // block_size)
        req = Request(f"capture-{i}", [0] * total, SamplingParams(temperature=0, max_tokens=1))
        req.block_ids = [1] * nblocks if share_block else list(range(block, block + nblocks))
        block += 0 if share_block else nblocks
        sched.scheduled.append(ScheduledRequest(req, history, n))
    return sched


def capture_model_prefill_and_mixed(runner, graphs: CudaGraphRunner, bar) -> None:
    """Capture piecewise graphs for every prefill bucket, largest first: a dummy step of exactly
    ``N`` tokens (one request, or several when ``N`` exceeds one request's block table)."""
    buffers = runner.buffers
    max_per_req = buffers.max_blocks_per_seq * buffers.block_size - 1
    for n in graphs.plan.prefill_capture_sizes:
        sched = _dummy(split_tokens(n, max_per_req), 0, buffers.block_size, share_block=False)
        graphs.capture_piecewise(n, sched)
        bar.update(1)


def capture_model(runner, graphs: CudaGraphRunner, bar) -> None:
    """Capture a full graph for every decode bucket, largest first: ``B`` one-token requests."""
    for b in graphs.plan.decode_capture_sizes:
        graphs.capture_full_decode(b, _dummy([1] * b, 1, runner.buffers.block_size, True))
        bar.update(1)


def capture_all(worker) -> CudaGraphRunner:
    """Capture the plan's graphs for ``worker.runner`` and attach them to it.

    Raises:
        RuntimeError: out of memory or a CUDA error during capture, naming the knobs to turn.
    """
    plan = worker.graph_plan
    gcfg = worker.config.graph_opt_config
    runner = worker.runner
    graphs = CudaGraphRunner(runner, plan, gcfg.cudagraph_num_of_warmups, gcfg.graph_opt_level)
    total = len(plan.prefill_capture_sizes) + len(plan.decode_capture_sizes)
    if gcfg.graph_opt_level > 0 and plan.prefill_graphs:
        logger.info(
            "graph_opt_level=%d: compiling the segments of %d prefill buckets with torch.compile "
            "before capture; expect tens of seconds per bucket at level 1 and minutes at level 2 "
            "(max-autotune)",
            gcfg.graph_opt_level,
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
            if plan.prefill_graphs:
                runner.capture_model_prefill_and_mixed(graphs, bar)
            if plan.decode_graphs:
                runner.capture_model(graphs, bar)
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
        "captured %d CUDA graphs (%d prefill buckets, %d decode buckets) in %.2f s, "
        "graph memory %.1f MiB",
        graphs.num_graphs(),
        len(graphs.piecewise),
        len(graphs.full),
        elapsed,
        used / 2**20,
    )
    logger.info("capture time by phase: %s", {k: round(v, 2) for k, v in graphs.seconds.items()})
    runner.graph_runner = graphs
    return graphs
