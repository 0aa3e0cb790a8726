"""The worker: device, model loading, KV cache sizing and allocation, warm-up.

One worker per tensor-parallel rank; every rank runs the same calls in the same order (rank 0's
:class:`~fastdeploy.worker.executor.TensorParallelWorker` sends them to the others), so their
collectives meet. It runs on CUDA or CPU; the name follows FastDeploy.
"""

from __future__ import annotations

import logging
import math
import sys
import time

import torch

from fastdeploy import envs
from fastdeploy.config import FDConfig
from fastdeploy.core.scheduler_output import SchedulerOutput
from fastdeploy.distributed.parallel_state import TPGroup, min_over_ranks
from fastdeploy.model_executor.graph_optimization.capture_order import (
    FIRST_DECODE_MAX,
    FIRST_PREFILL_MAX,
)
from fastdeploy.model_executor.graph_optimization.policy import GraphPlan
from fastdeploy.model_executor.layers.attention.selector import get_attention_backend_cls
from fastdeploy.model_executor.model_loader import check_tensor_parallel, get_model
from fastdeploy.platforms import get_platform
from fastdeploy.worker.gpu_model_runner import GPUModelRunner
from fastdeploy.worker.host_kv_pool import CopyJob, HostKVPool
from fastdeploy.worker.input_batch import InputBuffers, dummy_step

logger = logging.getLogger(__name__)

GiB = 1 << 30


def resolve_dtype(dtype: str, device_type: str, hf_config) -> torch.dtype:
    """``auto`` -> the platform default (float32 on CPU; on CUDA the checkpoint's float16/bfloat16,
    else bfloat16); otherwise the named dtype."""
    if dtype != "auto":
        return getattr(torch, dtype)
    if device_type == "cuda":
        cfg = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        if cfg in (torch.float16, torch.bfloat16, "float16", "bfloat16"):
            return getattr(torch, cfg) if isinstance(cfg, str) else cfg
    return get_platform(device_type).default_dtype


def flashinfer_cache_note() -> str:
    """``"; flashinfer JIT cache <dir> (FLASHINFER_WORKSPACE_BASE moves it)"`` when flashinfer
    was loaded by this process, else ``""``. A cold cache makes the kernel warm-up take seconds
    (2.69 s for the Llama-3-8B shape on an H200, 0.19 s warm), and flashinfer keeps the cache
    under ``$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer`` (default: the home directory), so a
    container pointing that variable at a kept volume starts warm."""
    if "flashinfer" not in sys.modules:
        return ""
    try:
        from flashinfer.jit.env import FLASHINFER_CACHE_DIR
    except (ImportError, AttributeError):  # another flashinfer layout: say nothing
        return ""
    return f"; flashinfer JIT cache {FLASHINFER_CACHE_DIR} (FLASHINFER_WORKSPACE_BASE moves it)"


class GpuWorker:
    """Owns the device, the model, the KV cache and the runner.

    Args:
        config: the resolved engine config (``EngineArgs.create_engine_config``: model source,
            device and attention backend decided).
        graph_plan: the resolved graph plan (workers receive it; they never re-derive or edit
            it).
        tp: this rank's tensor-parallel group (None: one rank). The model, the attention
            backend and the KV cache then hold ``1/N`` of the heads.

    Raises:
        ValueError: the model cannot be split over ``tp`` (names the numbers).
    """

    def __init__(self, config: FDConfig, graph_plan: GraphPlan, tp: TPGroup | None = None) -> None:
        self.config = config
        self.tp = tp if tp is not None and tp.world_size > 1 else None
        self.source = config.model_source
        self.graph_plan = graph_plan
        self.device = torch.device(config.device_config.device)
        if self.device.type == "cuda":
            self.device = torch.device("cuda", torch.cuda.current_device())
        hf = self.source.hf_config
        self.dtype = resolve_dtype(config.model_config.dtype, self.device.type, hf)
        self.num_layers = hf.num_hidden_layers
        self.head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        # this rank's heads (all of them with one rank)
        world = 1 if self.tp is None else self.tp.world_size
        self.num_heads, self.num_kv_heads = check_tensor_parallel(hf, world)
        self.runner: GPUModelRunner | None = None
        self.num_blocks = 0
        self.host_pool: HostKVPool | None = None
        # The graph capture's progress (CaptureProgress); None without graphs.
        self.capture_progress = None
        # Seconds of the warm-up's parts (kernel_warmup, capture_before_serving), for the
        # engine's start-up phases.
        self.startup_seconds: dict[str, float] = {}
        self._capture_phase = 0

    # ------------------------------------------------------------- loading
    def load_model(self) -> None:
        """Load weights and build the runner with persistent buffers."""
        cfg = self.config
        torch.manual_seed(cfg.model_config.seed)
        model = get_model(self.source, self.dtype, self.device, cfg.model_config.seed, tp=self.tp)
        backend_cls = get_attention_backend_cls(cfg.device_config.attention_backend)
        block_size = cfg.cache_config.block_size
        sched = cfg.scheduler_config
        max_blocks_per_seq = math.ceil(cfg.model_config.max_model_len / block_size)
        extra = {}
        if backend_cls.supports_graph_decode:  # sizes of its fixed graph metadata buffers
            extra = {
                "max_num_reqs": sched.max_num_seqs,
                "max_num_blocks": sched.max_num_seqs * max_blocks_per_seq,
            }
        backend = backend_cls(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            block_size,
            self.dtype,
            self.device,
            **extra,
        )
        max_tokens = max([sched.max_num_batched_tokens, *self.graph_plan.prefill_capture_sizes])
        buffers = InputBuffers(
            max_num_tokens=max_tokens,
            max_num_reqs=sched.max_num_seqs,
            max_blocks_per_seq=max_blocks_per_seq,
            block_size=block_size,
            device=self.device,
            max_model_len=cfg.model_config.max_model_len,
        )
        is_driver = self.tp is None or self.tp.is_driver
        self.runner = GPUModelRunner(
            model, backend, buffers, self.device, cfg.model_config.seed, is_driver=is_driver
        )
        logger.info(
            "loaded %s: %d layers, dtype %s, attention backend %s, device %s%s",
            self.source.path,
            self.num_layers,
            self.dtype,
            backend.name,
            self.device,
            "" if self.tp is None else f", rank {self.tp.rank}: {self.num_kv_heads} KV heads",
        )

    @property
    def bytes_per_block(self) -> int:
        """KV bytes of one block over all layers (this rank's KV heads)."""
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return (
            2
            * self.config.cache_config.block_size
            * self.num_kv_heads
            * self.head_dim
            * elem
            * self.num_layers
        )

    def blocks_needed_at_most(self) -> int:
        """Blocks for ``max_num_seqs`` sequences of ``max_model_len`` (+1 reserved null block)."""
        cfg = self.config
        per_seq = math.ceil(cfg.model_config.max_model_len / cfg.cache_config.block_size)
        return per_seq * cfg.scheduler_config.max_num_seqs + 1

    @property
    def kv_caches(self) -> list[torch.Tensor]:
        """The KV cache, one tensor per layer in the attention backend's ``kv_cache_shape``
        (``num_blocks`` blocks of this rank's KV heads, ``dtype``); empty before
        :meth:`initialize_kv_cache`. The same list object for the worker's lifetime (after
        :meth:`load_model`), so a transport may register it once.

        Raises:
            AttributeError: before :meth:`load_model` or after :meth:`shutdown`.
        """
        if self.runner is None:
            raise AttributeError("kv_caches: the model is not loaded")
        return self.runner.kv_caches

    def get_stats(self) -> dict:
        """Counters of the steps served since warm-up ended: ``steps_by_mode`` (mode ->
        steps, modes ``full``, ``piecewise``, ``eager``) and ``num_padded_tokens`` (padding rows
        the graph buckets added, tokens); with graphs, ``graph_capture``
        (:meth:`CaptureProgress.stats`: captured, failed and total graphs). A copy: later
        steps do not change it."""
        stats = {
            "steps_by_mode": dict(self.runner.steps_by_mode),
            "num_padded_tokens": self.runner.num_padded_tokens,
        }
        if self.capture_progress is not None:
            stats["graph_capture"] = self.capture_progress.stats()
        return stats

    # ------------------------------------------------------------- memory
    def determine_num_blocks(self) -> int:
        """KV blocks to allocate: ``num_gpu_blocks_override`` if set; on CUDA from a profile run
        and ``gpu_memory_utilization``; on CPU from ``FD_CPU_KV_CACHE_SPACE`` GiB. Never more than
        :meth:`blocks_needed_at_most`.

        A pool too small for one sequence of ``max_model_len`` is returned as it is: the engine
        then lowers ``max_model_len`` to what it holds, with a warning (``fit_max_model_len``).

        Under tensor parallelism every rank sizes its own pool (the budget is per device) and
        all of them take the smallest count, so block ids mean the same on every rank.
        """
        cfg = self.config
        if cfg.cache_config.num_gpu_blocks_override is not None:
            num_blocks = cfg.cache_config.num_gpu_blocks_override
        else:
            if self.device.type == "cuda":
                budget = self.determine_available_memory()
            else:
                budget = int(envs.FD_CPU_KV_CACHE_SPACE() * GiB)
            num_blocks = min(budget // self.bytes_per_block, self.blocks_needed_at_most())
        return min_over_ranks(num_blocks, self.tp)

    def determine_available_memory(self) -> int:
        """Bytes left for the KV cache on CUDA after a profile run at the largest step
        (``max_num_batched_tokens`` tokens over up to ``max_num_seqs`` requests)."""
        cfg = self.config
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        free, total = torch.cuda.mem_get_info()
        weights = torch.cuda.memory_allocated()
        sched = self._profile_step()
        blocks = sum(len(s.request.block_ids) for s in sched.scheduled) + 1
        self.initialize_kv_cache(blocks)
        self.runner.execute_model(sched)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        self.runner.bind_kv_caches([])
        torch.cuda.empty_cache()
        profile_kv = blocks * self.bytes_per_block
        activations = peak - weights - profile_kv
        non_torch = (total - free) - torch.cuda.memory_reserved()
        graphs = self.estimate_graph_memory(activations)
        budget = (
            int(total * cfg.cache_config.gpu_memory_utilization)
            - weights
            - activations
            - max(non_torch, 0)
            - graphs
        )
        logger.info(
            "memory: total %.2f GiB, weights %.2f GiB, activations (peak) %.2f GiB, "
            "other %.2f GiB, KV budget %.2f GiB at gpu_memory_utilization=%.2f",
            total / GiB,
            weights / GiB,
            activations / GiB,
            max(non_torch, 0) / GiB,
            budget / GiB,
            cfg.cache_config.gpu_memory_utilization,
        )
        return max(budget, 0)

    @property
    def graphs_capture_logits(self) -> bool:
        """Whether the decode graphs end with the logits and their argmax
        (``CudaGraphRunner``'s ``capture_logits``): not under tensor parallelism, whose LM head
        all-gathers the logits into a tensor of its own."""
        return self.tp is None

    def estimate_graph_memory(self, activations: int) -> int:
        """Bytes to keep free for CUDA graphs, taken out of the KV budget so that capture cannot
        run the device out of memory: the graphs' private pool holds about one forward's
        activations at the largest bucket (bounded by the profile run's), and while it does, the
        next bucket's eager warm-up needs up to as much again on the capture stream; plus the
        shared segment buffers (six ``[max_prefill_bucket, width]`` tensors), 256 MiB for the
        decode graphs' attention metadata and, on one GPU, the decode graphs' shared
        ``[max_decode_bucket, vocab]`` logits buffer; captured in the background, also the
        first phase's largest prefill bucket's share of the activations (its pool blocks are
        taken before the largest bucket's). Counting the pool alone overshot
        ``gpu_memory_utilization`` by 0.6 GiB with Qwen3-30B-A3B at 8,192 tokens on an H200. The
        capture log reports the memory actually used."""
        plan = self.graph_plan
        if not plan.any_graphs:
            return 0
        elem = torch.tensor([], dtype=self.dtype).element_size()
        hidden = self.source.hf_config.hidden_size
        width = (
            2 * hidden + 2 * self.num_heads * self.head_dim + 2 * self.num_kv_heads * self.head_dim
        )
        max_tokens = max(plan.prefill_capture_sizes, default=0)
        logits = 0
        if self.graphs_capture_logits:
            logits = max(plan.decode_capture_sizes, default=0) * self.source.hf_config.vocab_size
        # Captured in the background, the pool grows at the largest bucket of each phase: the
        # first phase's largest prefill bucket's activations come on top (capture_order).
        head = 0
        if plan.capture_in_background and max_tokens:
            first = max(
                (n for n in plan.prefill_capture_sizes if n <= FIRST_PREFILL_MAX), default=0
            )
            head = activations * first // max_tokens if first < max_tokens else 0
        return 2 * activations + head + (max_tokens * width + logits) * elem + (256 << 20)

    def _profile_step(self) -> SchedulerOutput:
        """The largest step: exactly ``max(max_num_batched_tokens, largest prefill bucket)``
        tokens over up to ``max_num_seqs`` requests. Exactly, because what the step allocates
        grows with its token count alone (the fused MoE op's workspace, for one, is sized by the
        tokens, never by how they are routed), so the profile counts it at the largest bucket."""
        sched_cfg = self.config.scheduler_config
        total = max([sched_cfg.max_num_batched_tokens, *self.graph_plan.prefill_capture_sizes])
        num_reqs = min(sched_cfg.max_num_seqs, total)
        base, extra = divmod(total, num_reqs)
        sizes = [base + 1] * extra + [base] * (num_reqs - extra)
        return dummy_step(sizes, self.config.cache_config.block_size)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate one KV tensor per layer of ``num_blocks`` blocks (zeros)."""
        shape = self.runner.attn_backend.kv_cache_shape(num_blocks)
        zeros = [
            torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)
        ]
        self.runner.bind_kv_caches(zeros)
        self.num_blocks = num_blocks
        logger.info(
            "KV cache: %d blocks x %d tokens (block 0 is the reserved null block), %.2f GiB",
            num_blocks,
            self.config.cache_config.block_size,
            num_blocks * self.bytes_per_block / GiB,
        )

    # ------------------------------------------------------------- host KV tier
    def initialize_host_kv_pool(self, num_host_blocks: int) -> None:
        """Allocate the host tier: ``num_host_blocks`` blocks per layer in the device cache's
        block layout (pinned on CUDA). Call after :meth:`initialize_kv_cache`."""
        block_shape = tuple(self.kv_caches[0].shape[1:])
        start = time.perf_counter()
        self.host_pool = HostKVPool(
            num_host_blocks, block_shape, self.num_layers, self.dtype, self.device
        )
        logger.info(
            "host KV tier: %d blocks, %.2f GiB%s, allocated in %.1f s",
            num_host_blocks,
            num_host_blocks * self.bytes_per_block / GiB,
            " pinned" if self.device.type == "cuda" else "",
            time.perf_counter() - start,
        )

    def store_blocks(self, device_blocks: list[int], host_blocks: list[int]) -> CopyJob:
        """Copy ``device_blocks`` of every layer into host blocks ``host_blocks`` (write-through,
        on the host pool's side stream after the work already queued on the device)."""
        return self.host_pool.store(self.kv_caches, device_blocks, host_blocks)

    def load_blocks(
        self, host_blocks: list[int], device_blocks: list[int], per_layer: bool
    ) -> CopyJob:
        """Copy host blocks ``host_blocks`` into ``device_blocks`` of every layer (swap-in);
        ``per_layer``: one event per layer, in layer order."""
        return self.host_pool.load(self.kv_caches, host_blocks, device_blocks, per_layer)

    # ------------------------------------------------------------- warm-up
    def graph_optimize_and_warm_up_model(self) -> None:
        """Capture CUDA graphs per the plan, then reset the sampling RNG so a seed gives the
        same output with and without graphs, and zero the step counters (:meth:`get_stats`
        counts served steps only, not the memory profile or the warm-up).

        Before serving (``plan.capture_in_background`` false): every bucket inside one capture
        session (prefill/mixed first, then decode). In the background (true): only the kernel
        warm-up here; the engine then serves and calls :meth:`capture_next_graph` between
        steps (:meth:`start_background_capture`).

        Raises:
            RuntimeError: capture before serving failed (out of memory or a CUDA error),
                naming the knobs.
        """
        from fastdeploy.model_executor.graph_optimization.capture_order import (
            CaptureProgress,
            blocking_order,
        )

        plan = self.graph_plan
        if plan.any_graphs:
            from fastdeploy.model_executor.graph_optimization.capture import capture_session

            # One eager prefill and one eager decode step first: kernel libraries build or load
            # their kernels on first use (flashinfer's JIT), which is not capture time.
            start = time.perf_counter()
            block_size = self.config.cache_config.block_size
            sched = self.config.scheduler_config
            prefill = min(16, sched.max_num_batched_tokens, self.config.model_config.max_model_len)
            self.runner.execute_model(dummy_step([prefill], block_size))
            decode = [1] * min(2, sched.max_num_seqs)
            self.runner.execute_model(dummy_step(decode, block_size, history=1, share_block=True))
            torch.cuda.synchronize()
            self.startup_seconds["kernel_warmup"] = time.perf_counter() - start
            logger.info(
                "kernel warm-up before capture: %.2f s%s",
                time.perf_counter() - start,
                flashinfer_cache_note(),
            )
            gcfg = self.config.graph_opt_config
            graphs = self.runner.init_graph_runner(
                plan,
                gcfg.cudagraph_num_of_warmups,
                gcfg.graph_opt_level,
                capture_logits=self.graphs_capture_logits,
            )
            if plan.capture_in_background:
                self.start_background_capture(graphs)
            else:
                start = time.perf_counter()
                try:
                    with capture_session(graphs) as bar:
                        if plan.prefill_graphs:
                            self.runner.capture_model_prefill_and_mixed(bar)
                        if plan.decode_graphs:
                            self.runner.capture_model(bar)
                except RuntimeError:
                    self.runner.graph_runner = None
                    raise
                progress = CaptureProgress(
                    blocking_order(plan, graphs.capture_logits), background=False
                )
                for task in progress.tasks:
                    progress.captured(task)
                progress.seconds = graphs.capture_seconds
                progress.seconds_by_phase = {"1": graphs.capture_seconds}
                self.capture_progress = progress
                self.startup_seconds["capture_before_serving"] = time.perf_counter() - start
        self.runner.reset_sampling_state()
        self.runner.reset_step_counters()

    # ------------------------------------------------------------- background capture
    def start_background_capture(self, graphs) -> None:
        """Serve before the graphs are captured: install ``graphs`` (a ``CudaGraphRunner``,
        or a stand-in with its interface) empty, open its capture window, and let every step
        run eagerly until its bucket is captured by :meth:`capture_next_graph`, in the order
        of :func:`~fastdeploy.model_executor.graph_optimization.capture_order.background_order`
        over ``graphs.plan``."""
        from fastdeploy.model_executor.graph_optimization.capture_order import (
            CaptureProgress,
            background_order,
        )

        progress = CaptureProgress(background_order(graphs.plan, graphs.capture_logits))
        self.runner.graph_runner = graphs
        self.runner.capture_progress = progress
        self.capture_progress = progress
        self._capture_phase = 0
        graphs.begin_capture()
        logger.info(
            "serving before capture: %d graphs to capture between steps (decode <= %d and "
            "prefill <= %d tokens first); steps run eagerly until their bucket is captured",
            len(progress.tasks),
            FIRST_DECODE_MAX,
            FIRST_PREFILL_MAX,
        )

    def graph_capture_pending(self) -> bool:
        """Whether a background capture has graphs left to capture."""
        progress = self.capture_progress
        return progress is not None and progress.background and not progress.done

    def capture_next_graph(self) -> dict | None:
        """Capture the next graph of the background capture (between two steps, on the
        engine's thread: the caller's). Waits for the step in flight first, so the capture has
        the device to itself. A capture that raises leaves its bucket eager, logged and
        recorded (``get_stats()["graph_capture"]["failures"]``); the other buckets go on.
        Under tensor parallelism every rank captures the same task and the ranks agree on the
        outcome (the minimum of a success flag over the control group): a bucket replays only
        when every rank captured it, and a rank that captured it alone drops its graph.

        Returns:
            ``{"kind", "size", "ok", "seconds"}`` of the task, or None when nothing is pending.
        """
        from fastdeploy.model_executor.graph_optimization.capture import gap_capture

        if not self.graph_capture_pending():
            return None
        progress = self.capture_progress
        graphs = self.runner.graph_runner
        task = progress.next_task()
        if task.phase != self._capture_phase:
            graphs.begin_phase()
            self._capture_phase = task.phase
        start = time.perf_counter()
        reason = None
        cuda = self.device.type == "cuda"
        try:
            with gap_capture(cuda):
                self.runner.capture_task(task)
        except Exception as e:  # noqa: BLE001 - any capture error leaves one bucket eager
            reason = f"{type(e).__name__}: {e}"
            if cuda:
                torch.cuda.empty_cache()
        agreed = min_over_ranks(int(reason is None), self.tp)
        if agreed and reason is None:
            seconds = time.perf_counter() - start
            progress.captured(task, seconds)
        else:
            if reason is None:  # captured here, failed on another rank: drop ours
                graphs.discard(task.kind, task.size)
                reason = "capture failed on another tensor-parallel rank"
            seconds = time.perf_counter() - start
            progress.failed(task, reason, seconds)
            logger.warning(
                "capture of the %s graph of bucket %d failed; that bucket runs eagerly, the "
                "others are unaffected: %s",
                task.kind,
                task.size,
                reason,
            )
        if progress.done:
            graphs.end_capture()
            graphs.capture_seconds = progress.seconds
            stats = progress.stats()
            logger.info(
                "background capture done: %d of %d graphs captured, %d failed, %.2f s of capture%s",
                stats["captured"],
                stats["total"],
                stats["failed"],
                progress.seconds,
                f", {torch.cuda.memory_reserved() / GiB:.2f} GiB reserved" if cuda else "",
            )
        return {"kind": task.kind, "size": task.size, "ok": reason is None, "seconds": seconds}

    def dispatch(self, sched: SchedulerOutput) -> tuple[str, int | None]:
        """The step's ``(mode, bucket)`` (:meth:`GPUModelRunner.dispatch`): what rank 0 sends
        the other ranks with the step, so that they replay the same graph."""
        return self.runner.dispatch(sched)

    def execute_model(
        self,
        sched: SchedulerOutput,
        dispatch: tuple[str, int | None] | None = None,
        layer_events: list | None = None,
    ):
        """Run one scheduled step; see :meth:`GPUModelRunner.execute_model`."""
        return self.runner.execute_model(sched, dispatch, layer_events)

    def execute_model_async(self, sched: SchedulerOutput, layer_events: list | None = None):
        """Queue one scheduled step without waiting for its tokens; see
        :meth:`GPUModelRunner.execute_model_async`."""
        return self.runner.execute_model_async(sched, None, layer_events)

    def shutdown(self) -> None:
        """Release the host KV tier (once its copies ended), the graphs, the KV cache and the
        model (idempotent)."""
        if self.host_pool is not None:
            self.host_pool.release()
            self.host_pool = None
        if self.runner is not None:
            self.runner.release()
            self.runner = None
