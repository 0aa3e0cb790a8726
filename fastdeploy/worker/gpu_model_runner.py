"""The model runner: inputs into persistent buffers, one forward, sampling.

Runs on CUDA and on CPU (the name follows FastDeploy). CUDA graph capture and replay live in
:mod:`fastdeploy.model_executor.graph_optimization`; this runner asks it which mode a step uses.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from fastdeploy.core.request import Request
from fastdeploy.core.scheduler_output import SchedulerOutput
from fastdeploy.model_executor.forward_meta import ForwardMeta
from fastdeploy.model_executor.layers.attention.backend import AttentionBackend
from fastdeploy.model_executor.layers.sampler import Sampler, SamplingMetadata
from fastdeploy.worker.input_batch import InputBuffers, StepInputs

logger = logging.getLogger(__name__)


@dataclass
class SampledToken:
    """One sampled token; ``top_logprobs`` is ``[(token_id, logprob), ...]`` when asked."""

    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


class GPUModelRunner:
    """Executes scheduled steps of one model on one device.

    Args:
        model: a model from :mod:`fastdeploy.model_executor.models` (eval mode, on ``device``).
        attn_backend: attention backend instance sized for the model.
        buffers: the persistent input buffers.
        device: the model's device.
        seed: seed of the engine-wide generator used by unseeded sampled requests.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        attn_backend: AttentionBackend,
        buffers: InputBuffers,
        device: torch.device,
        seed: int,
    ) -> None:
        self.model = model
        self.attn_backend = attn_backend
        self.buffers = buffers
        self.device = device
        self.seed = seed
        self.kv_caches: list[torch.Tensor] = []
        self.sampler = Sampler()
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self._request_generators: dict[str, torch.Generator] = {}
        self.graph_runner = None  # set by the worker when CUDA graphs are on
        self.steps_by_mode = {"full": 0, "piecewise": 0, "eager": 0}
        self.num_padded_tokens = 0

    def reset_sampling_state(self) -> None:
        """Reseed the engine generator (after warm-up, so a seed gives the same output with and
        without graphs) and drop per-request generators."""
        self.generator.manual_seed(self.seed)
        self._request_generators.clear()

    # ---------------------------------------------------------------- capture
    def capture_model_prefill_and_mixed(self, graphs, bar) -> None:
        """Capture piecewise graphs for every prefill/mixed token bucket (warm-up only)."""
        from fastdeploy.model_executor.graph_optimization import capture

        capture.capture_model_prefill_and_mixed(self, graphs, bar)

    def capture_model(self, graphs, bar) -> None:
        """Capture full graphs for every decode bucket (warm-up only)."""
        from fastdeploy.model_executor.graph_optimization import capture

        capture.capture_model(self, graphs, bar)

    # ---------------------------------------------------------------- step
    def build_forward_meta(self, inputs: StepInputs, graph_mode: str = "eager") -> ForwardMeta:
        """Attention metadata is built here, once per step, never per layer."""
        return ForwardMeta(
            num_tokens=inputs.num_tokens,
            num_reqs=inputs.batch.num_reqs,
            attn_backend=self.attn_backend,
            attn_metadata=self.attn_backend.build_metadata(inputs.batch),
            kv_caches=self.kv_caches,
            is_decode_only=inputs.batch.is_decode_only,
            step_use_cudagraph=graph_mode != "eager",
            graph_mode=graph_mode,
        )

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> dict[str, SampledToken]:
        """Run one step and sample a token for every request that reaches its last known token.

        Returns:
            request id -> sampled token, for the requests with ``ScheduledRequest.samples``.
        """
        for rid in sched.finished_request_ids:
            self._request_generators.pop(rid, None)
        for req in sched.preempted:
            self._request_generators.pop(req.request_id, None)
        if sched.is_empty:
            return {}
        hidden, inputs = self._forward(sched)
        if not inputs.sampling_reqs:
            return {}
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        reqs = [s.request for s in sched.scheduled if s.samples]
        out = self.sampler(logits, self._sampling_metadata(reqs))
        return self._to_host(out, inputs.sampling_reqs)

    def _forward(self, sched: SchedulerOutput) -> tuple[torch.Tensor, StepInputs]:
        """Dispatch on host data: a captured graph if one fits, else eager."""
        if self.graph_runner is not None:
            result = self.graph_runner.try_run(self, sched)
            if result is not None:
                hidden, inputs, mode = result
                self.steps_by_mode[mode] += 1
                self.num_padded_tokens += inputs.padded - inputs.num_tokens
                return hidden, inputs
        inputs = self.buffers.prepare(sched)
        meta = self.build_forward_meta(inputs)
        hidden = self.model(inputs.input_ids, inputs.positions, meta)
        self.steps_by_mode["eager"] += 1
        return hidden, inputs

    def _sampling_metadata(self, reqs: list[Request]) -> SamplingMetadata:
        params = [r.sampling_params for r in reqs]
        gens: list[torch.Generator | None] = []
        for r, p in zip(reqs, params):
            if p.seed is None:
                gens.append(self.generator)
                continue
            gen = self._request_generators.get(r.request_id)
            if gen is None:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(p.seed)
                self._request_generators[r.request_id] = gen
            gens.append(gen)
        logprobs = [p.logprobs for p in params if p.logprobs is not None]
        return SamplingMetadata(
            temperature=torch.tensor(
                [p.temperature for p in params], dtype=torch.float32, device=self.device
            ),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=self.device),
            top_k=torch.tensor(
                [max(p.top_k, 0) for p in params], dtype=torch.int64, device=self.device
            ),
            generators=gens,
            all_greedy=all(p.greedy for p in params),
            max_num_logprobs=max(logprobs) if logprobs else None,
        )

    def _to_host(self, out, request_ids: list[str]) -> dict[str, SampledToken]:
        ids = out.token_ids.tolist()
        result = {rid: SampledToken(tok) for rid, tok in zip(request_ids, ids)}
        if out.logprobs is not None:
            lps = out.logprobs.tolist()
            tops = out.top_ids.tolist() if out.top_ids is not None else None
            top_lps = out.top_logprobs.tolist() if out.top_logprobs is not None else None
            for i, rid in enumerate(request_ids):
                result[rid].logprob = lps[i]
                if tops is not None:
                    result[rid].top_logprobs = list(zip(tops[i], top_lps[i]))
        return result
