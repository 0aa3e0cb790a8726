"""The engine core: admission, the step loop, stop conditions.

``LLMEngine.step()`` asks the scheduler for a batch, runs it on the worker, appends the sampled
tokens, and lets the :class:`~fastdeploy.engine.stop_checker.StopChecker` decide, token by token,
which requests have ended (eos, stop token ids, stop strings, ``max_tokens``, ``max_model_len``,
all under ``min_tokens``) and what text they add. Detokenisation runs here, on the engine's
thread (about 0.8 us per token), because the stop decision needs the text: a request that hits a
stop string frees its KV blocks in the same step, and the front ends only pass text on.

Admission is bounded by the KV pool: at start-up ``max_model_len`` is lowered, with a warning, to
what the pool holds for one request (``fit_max_model_len`` in
:mod:`fastdeploy.cache_manager.kv_cache_manager`), so a prompt that could never fit is refused at
once with the numbers, and a running request that outgrows the free blocks is preempted and
resumed, never aborted.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from fastdeploy import envs
from fastdeploy.config import FDConfig
from fastdeploy.core.outputs import EngineOutput
from fastdeploy.core.request import Request, check_prompt, check_sampling
from fastdeploy.core.sampling_params import SamplingParams
from fastdeploy.engine.args_utils import EngineArgs

if TYPE_CHECKING:
    from fastdeploy.model_executor.graph_optimization.policy import GraphPlan

logger = logging.getLogger(__name__)


def check_device_available(device: str) -> None:
    """Refuse to start on a device this machine does not have (``--print-config`` still shows
    the plan of any device; only a running engine needs it).

    Raises:
        ValueError: ``device == "cuda"`` and CUDA is not available, saying why.
    """
    if device != "cuda":
        return
    import torch

    if torch.cuda.is_available():
        return
    why = (
        f"this torch build ({torch.__version__}) has no CUDA support"
        if torch.version.cuda is None
        else "no CUDA device is visible (check CUDA_VISIBLE_DEVICES and the driver)"
    )
    raise ValueError(f"device='cuda' is invalid on this machine: {why}; allowed: cpu or auto")


class LLMEngine:
    """Loads the model and drives steps. Not thread-safe: one thread calls it.

    Args:
        config: a config resolved by :meth:`EngineArgs.create_engine_config` (model source,
            device and attention backend decided); see :meth:`from_engine_args`.
        graph_plan: the plan of ``config`` when the caller already resolved it (``--print-config``
            shows the same one); None resolves it here.

    Attributes:
        max_model_len: the admission bound: the configured ``max_model_len``, or less when the
            KV pool holds fewer tokens for one request (``max_model_len_note`` then says so).

    Raises:
        ValueError: a setting not supported yet, a bad plan, a device this machine lacks, or a KV
            pool too small for any request.
    """

    def __init__(self, config: FDConfig, graph_plan: GraphPlan | None = None) -> None:
        from fastdeploy.cache_manager.kv_cache_manager import KVCacheManager, fit_max_model_len
        from fastdeploy.engine.stop_checker import StopChecker
        from fastdeploy.model_executor.graph_optimization.policy import resolve_graph_plan
        from fastdeploy.scheduler.scheduler import Scheduler
        from fastdeploy.worker.gpu_worker import GpuWorker

        config.check_supported()
        check_device_available(config.device_config.device)
        self.config = config
        self.graph_plan = graph_plan if graph_plan is not None else resolve_graph_plan(config)
        self.source = config.model_source
        logger.info("graph plan: %s", self.graph_plan.to_dict())
        self.tokenizer = None
        if not config.model_config.skip_tokenizer_init:
            self.tokenizer = self.source.load_tokenizer()
        self.vocab_size = self.source.hf_config.vocab_size
        self.eos_token_ids = frozenset(self._eos_ids())
        self.worker = GpuWorker(self.config, self.graph_plan)
        self.worker.load_model()
        num_blocks = self.worker.determine_num_blocks()
        cache = self.config.cache_config
        self.max_model_len, self.max_model_len_note = fit_max_model_len(
            config.model_config.max_model_len, num_blocks, cache.block_size
        )
        self._log_kv_cache(num_blocks)
        self.worker.initialize_kv_cache(num_blocks)
        self.worker.graph_optimize_and_warm_up_model()
        self.kv_cache_manager = KVCacheManager(
            num_blocks, cache.block_size, cache.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.config.scheduler_config, self.kv_cache_manager, self.max_model_len
        )
        self.stop_checker = StopChecker(self.max_model_len, self.tokenizer)

    def _log_kv_cache(self, num_blocks: int) -> None:
        block_size = self.config.cache_config.block_size
        source = (
            f"FD_CPU_KV_CACHE_SPACE={envs.FD_CPU_KV_CACHE_SPACE():g} GiB"
            if self.config.device_config.device == "cpu"
            else f"gpu_memory_utilization={self.config.cache_config.gpu_memory_utilization:g}"
        )
        if self.config.cache_config.num_gpu_blocks_override is not None:
            source = f"num_gpu_blocks_override={num_blocks}"
        logger.info(
            "KV cache: %d usable blocks of %d tokens = %d tokens (set by %s)",
            num_blocks - 1,
            block_size,
            (num_blocks - 1) * block_size,
            source,
        )
        if self.max_model_len_note is not None:
            logger.warning(
                "%s; raise the KV cache size to serve longer requests", self.max_model_len_note
            )

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        """Resolve ``engine_args`` (one pass, see :meth:`EngineArgs.create_engine_config`) and
        start an engine on the result.

        Raises:
            ValueError: a bad or not yet supported argument; FileNotFoundError: missing model.
        """
        return cls(engine_args.create_engine_config())

    def _eos_ids(self) -> set[int]:
        ids = set()
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        cfg_eos = getattr(self.source.hf_config, "eos_token_id", None)
        if isinstance(cfg_eos, int):
            ids.add(cfg_eos)
        elif isinstance(cfg_eos, (list, tuple)):
            ids.update(cfg_eos)
        return ids

    # ------------------------------------------------------------ requests
    def check_request(
        self, prompt_token_ids: list[int], sampling_params: SamplingParams | None = None
    ) -> None:
        """Admission check of a request, the one every front end calls before queuing.

        Pure: it reads only what start-up fixed (``max_model_len``, the vocabulary size, whether
        there is a tokenizer), so it is safe to call from another thread than the one that steps
        the engine.

        Raises:
            ValueError: empty prompt, a token id outside the vocabulary, a ``stop_token_ids`` or
                ``logit_bias`` id outside it, or stop strings without a tokenizer.
            PromptTooLongError: a prompt of ``max_model_len`` tokens or more (no room for one
                output token; the message names both lengths, and the KV pool when that is what
                bounds ``max_model_len``).
        """
        check_prompt(prompt_token_ids, self.max_model_len, self.vocab_size, self.max_model_len_note)
        if sampling_params is not None:
            check_sampling(sampling_params, self.vocab_size, self.tokenizer is not None)

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams
    ) -> Request:
        """Queue a request.

        Raises:
            ValueError: what :meth:`check_request` raises, or a duplicate id.
        """
        self.check_request(prompt_token_ids, sampling_params)
        if self.scheduler.get_request(request_id) is not None:
            raise ValueError(f"request id {request_id!r} is already in use")
        request = Request(
            request_id, list(prompt_token_ids), sampling_params, eos_token_ids=self.eos_token_ids
        )
        self.stop_checker.start(request)
        self.scheduler.add_request(request)
        return request

    def abort_request(self, request_id: str) -> bool:
        """Abort a waiting or running request and free its KV blocks; False if unknown."""
        return self.scheduler.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ------------------------------------------------------------ the step
    def step(self) -> list[EngineOutput]:
        """Schedule, run and post-process one step; returns this step's new tokens and text.

        A request the :class:`~fastdeploy.engine.stop_checker.StopChecker` ends is finished in
        the scheduler (its KV blocks freed) before this returns.
        """
        sched = self.scheduler.schedule()
        # Also when empty: the runner frees the sampling state of finished requests.
        sampled = self.worker.execute_model(sched)
        if sched.is_empty:
            return []
        self.scheduler.update_from_output(sched, {rid: s.token_id for rid, s in sampled.items()})
        now = time.monotonic()
        outputs = []
        for rid, tok in sampled.items():
            request = self.scheduler.get_request(rid)
            if request is None:  # aborted since it was scheduled
                continue
            logprobs = None
            k = request.sampling_params.logprobs
            if k is not None:
                top = (tok.top_logprobs or [])[:k]
                logprobs = [{"token_id": tok.token_id, "logprob": tok.logprob, "top_logprobs": top}]
                request.output_logprobs.extend(logprobs)
            status = self.stop_checker.check(request, tok.token_id)
            finished = status is not None
            if finished:
                request.finish_time = now
                self.scheduler.finish_request(request, status)
            detok = request.detokenizer
            outputs.append(
                EngineOutput(
                    rid,
                    [tok.token_id],
                    logprobs,
                    finished,
                    status.value if finished else None,
                    request.num_prompt_tokens,
                    request.num_cached_tokens,
                    new_text=detok.take_delta(finished) if detok is not None else "",
                    stop_reason=request.stop_reason if finished else None,
                )
            )
        return outputs

    def get_stats(self) -> dict:
        """Counters for metrics: running/waiting requests, KV usage, steps by graph mode."""
        runner = self.worker.runner
        return {
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "kv_cache_usage": self.kv_cache_manager.usage,
            "num_free_blocks": self.kv_cache_manager.num_free_blocks,
            "num_total_blocks": self.kv_cache_manager.num_usable_blocks,
            "steps_by_mode": dict(runner.steps_by_mode),
            "num_padded_tokens": runner.num_padded_tokens,
        }

    def shutdown(self) -> None:
        """Release the model, KV cache and graphs (an engine can be created again afterwards)."""
        worker = getattr(self, "worker", None)
        if worker is not None and worker.runner is not None:
            if worker.runner.graph_runner is not None:
                worker.runner.graph_runner.release()
            worker.runner.kv_caches.clear()
            worker.runner = None
        self.worker = None
        import gc

        import torch

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
