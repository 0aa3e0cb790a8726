"""The engine core: admission, the step loop, stop conditions.

``LLMEngine.step()`` asks the scheduler for a batch, runs it on the worker, appends the sampled
tokens and finishes requests that hit eos, a stop token id, ``max_tokens`` or ``max_model_len``.
Stop *strings* need detokenised text, so
:class:`~fastdeploy.engine.output_processor.OutputProcessor` finds them and calls
:meth:`LLMEngine.finish_request`. The engine itself never tokenises or detokenises; it holds
the tokenizer only to hand it to front ends.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from fastdeploy.config import FDConfig
from fastdeploy.core.outputs import EngineOutput
from fastdeploy.core.request import Request, RequestStatus, check_prompt
from fastdeploy.core.sampling_params import SamplingParams
from fastdeploy.engine.args_utils import EngineArgs

if TYPE_CHECKING:
    from fastdeploy.model_executor.graph_optimization.policy import GraphPlan

logger = logging.getLogger(__name__)


class LLMEngine:
    """Loads the model and drives steps. Not thread-safe: one thread calls it.

    Args:
        config: a config resolved by :meth:`EngineArgs.create_engine_config` (model source,
            device and attention backend decided); see :meth:`from_engine_args`.
        graph_plan: the plan of ``config`` when the caller already resolved it (``--print-config``
            shows the same one); None resolves it here.

    Raises:
        ValueError: a setting not supported yet, or a bad plan.
    """

    def __init__(self, config: FDConfig, graph_plan: GraphPlan | None = None) -> None:
        from fastdeploy.cache_manager.kv_cache_manager import KVCacheManager
        from fastdeploy.model_executor.graph_optimization.policy import resolve_graph_plan
        from fastdeploy.scheduler.scheduler import Scheduler
        from fastdeploy.worker.gpu_worker import GpuWorker

        config.check_supported()
        self.config = config
        self.graph_plan = graph_plan if graph_plan is not None else resolve_graph_plan(config)
        self.source = config.model_source
        logger.info("graph plan: %s", self.graph_plan.to_dict())
        self.tokenizer = None
        if not config.model_config.skip_tokenizer_init:
            self.tokenizer = self.source.load_tokenizer()
        self.max_model_len = self.config.model_config.max_model_len
        self.vocab_size = self.source.hf_config.vocab_size
        self.eos_token_ids = self._eos_ids()
        self.worker = GpuWorker(self.config, self.graph_plan)
        self.worker.load_model()
        num_blocks = self.worker.determine_num_blocks()
        self.worker.initialize_kv_cache(num_blocks)
        self.worker.graph_optimize_and_warm_up_model()
        cache = self.config.cache_config
        self.kv_cache_manager = KVCacheManager(
            num_blocks, cache.block_size, cache.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.config.scheduler_config, self.kv_cache_manager, self.max_model_len
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
    def check_request(self, prompt_token_ids: list[int]) -> None:
        """Admission check of a prompt, the one every front end calls before queuing.

        Pure: it reads only ``max_model_len`` and ``vocab_size``, fixed at start-up, so it is
        safe to call from another thread than the one that steps the engine.

        Raises:
            ValueError: empty prompt, a prompt of ``max_model_len`` tokens or more (no room for
                one output token; the message names both lengths), or a token id outside the
                vocabulary.
        """
        check_prompt(prompt_token_ids, self.max_model_len, self.vocab_size)

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams
    ) -> Request:
        """Queue a request.

        Raises:
            ValueError: what :meth:`check_request` raises, or a duplicate id.
        """
        self.check_request(prompt_token_ids)
        if self.scheduler.get_request(request_id) is not None:
            raise ValueError(f"request id {request_id!r} is already in use")
        request = Request(request_id, list(prompt_token_ids), sampling_params)
        self.scheduler.add_request(request)
        return request

    def abort_request(self, request_id: str) -> bool:
        """Abort a waiting or running request and free its KV blocks; False if unknown."""
        return self.scheduler.abort_request(request_id)

    def finish_request(self, request_id: str, finish_reason: str = "stop") -> None:
        """Finish a request early (a stop string was found); frees its KV blocks."""
        request = self.scheduler.get_request(request_id)
        if request is not None and not request.is_finished:
            self.scheduler.finish_request(request, RequestStatus(finish_reason))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ------------------------------------------------------------ the step
    def step(self) -> list[EngineOutput]:
        """Schedule, run and post-process one step; returns this step's new tokens."""
        from fastdeploy.scheduler.scheduler import InsufficientKVCacheError

        try:
            sched = self.scheduler.schedule()
        except InsufficientKVCacheError as e:
            # The pool cannot hold even this one request: fail it, keep serving the others.
            logger.error("aborting request %s: %s", e.request_id, e)
            request = self.scheduler.get_request(e.request_id)
            self.scheduler.abort_request(e.request_id)
            return [
                EngineOutput(
                    e.request_id,
                    [],
                    None,
                    True,
                    "abort",
                    request.num_prompt_tokens if request else 0,
                )
            ]
        if sched.is_empty:
            return []
        sampled = self.worker.execute_model(sched)
        self.scheduler.update_from_output(sched, {rid: s.token_id for rid, s in sampled.items()})
        now = time.monotonic()
        outputs = []
        for rid, tok in sampled.items():
            request = self.scheduler.get_request(rid)
            logprobs = None
            k = request.sampling_params.logprobs
            if k is not None:
                top = (tok.top_logprobs or [])[:k]
                logprobs = [{"token_id": tok.token_id, "logprob": tok.logprob, "top_logprobs": top}]
                request.output_logprobs.extend(logprobs)
            status = self._check_stop(request, tok.token_id)
            if status is not None:
                request.finish_time = now
                self.scheduler.finish_request(request, status)
            outputs.append(
                EngineOutput(
                    rid,
                    [tok.token_id],
                    logprobs,
                    status is not None,
                    status.value if status is not None else None,
                    request.num_prompt_tokens,
                    request.num_cached_tokens,
                )
            )
        return outputs

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        n_out = len(request.output_token_ids)
        if n_out >= params.min_tokens:
            if token in params.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
            if not params.ignore_eos and token in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and n_out >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

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
