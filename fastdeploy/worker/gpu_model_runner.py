"""The model runner: inputs into persistent buffers, one forward, sampling, and the capture loops.

Runs on CUDA and on CPU (the name follows FastDeploy). The graph package
(:mod:`fastdeploy.model_executor.graph_optimization`) is its tool: the plan's pure
:meth:`~fastdeploy.model_executor.graph_optimization.policy.GraphPlan.dispatch` picks a step's mode
and bucket, and :class:`~fastdeploy.model_executor.graph_optimization.graph_runner.CudaGraphRunner`
captures or replays that bucket from inputs this runner prepared.
"""

from __future__ import annotations

import logging

import torch

from fastdeploy.core.scheduler_output import SchedulerOutput
from fastdeploy.model_executor.forward_meta import ForwardMeta
from fastdeploy.model_executor.graph_optimization.policy import GraphPlan
from fastdeploy.model_executor.layers.attention.backend import AttentionBackend
from fastdeploy.model_executor.layers.sampler import Sampler
from fastdeploy.worker.async_output import OutputStager, PendingOutput, SampledToken
from fastdeploy.worker.grammar_mask import GrammarMask
from fastdeploy.worker.input_batch import (
    InputBuffers,
    LastSampled,
    StepInputs,
    dummy_step,
    split_tokens,
)
from fastdeploy.worker.prompt_logprobs import compute_prompt_logprobs, plan_prompt_logprobs
from fastdeploy.worker.sampling_buffers import SamplingBuffers

logger = logging.getLogger(__name__)


class GPUModelRunner:
    """Executes scheduled steps of one model on one device.

    Args:
        model: a model from :mod:`fastdeploy.model_executor.models` (eval mode, on ``device``).
        attn_backend: attention backend instance sized for the model.
        buffers: the persistent input buffers.
        device: the model's device.
        seed: seed of the engine-wide generator used by unseeded sampled requests.
        is_driver: False on tensor-parallel ranks other than 0: they run the forward and the
            logits (whose all-gather every rank joins) but never sample; rank 0 alone samples,
            from the full logits, so the ranks cannot disagree on a token.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        attn_backend: AttentionBackend,
        buffers: InputBuffers,
        device: torch.device,
        seed: int,
        is_driver: bool = True,
    ) -> None:
        self.model = model
        self.is_driver = is_driver
        self.attn_backend = attn_backend
        self.buffers = buffers
        self.device = device
        self.seed = seed
        self.kv_caches: list[torch.Tensor] = []
        self.sampler = Sampler()
        self.sampling = SamplingBuffers(buffers.max_num_reqs, device, seed)
        self.grammar_mask = GrammarMask(buffers.max_num_reqs, device)
        self.outputs = OutputStager(buffers.max_num_reqs, device)
        # The latest step's sampled tokens on the device: the next step's placeholder rows
        # (overlap schedule) read them there.
        self.last_sampled: LastSampled | None = None
        self.graph_runner = None  # set by the worker when CUDA graphs are on
        # While graphs are captured in the background: which buckets replay (a
        # CaptureProgress); None when every bucket of the plan is captured (or none is).
        self.capture_progress = None
        # Steps run by graph mode and the padding rows they carried (see reset_step_counters).
        self.steps_by_mode = {"full": 0, "piecewise": 0, "eager": 0}
        self.num_padded_tokens = 0

    def reset_sampling_state(self) -> None:
        """Reseed the engine generator (after warm-up, so a seed gives the same output with and
        without graphs) and free every request's sampling slot (the warm-up's dummy requests)."""
        self.sampling.reset()

    def reset_step_counters(self) -> None:
        """Zero ``steps_by_mode`` and ``num_padded_tokens`` (at the end of warm-up, so that they
        count served steps only, not the memory profile or the kernel warm-up)."""
        self.steps_by_mode = dict.fromkeys(self.steps_by_mode, 0)
        self.num_padded_tokens = 0

    def bind_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """Use ``kv_caches`` (one tensor per layer, the backend's ``kv_cache_shape``) from the
        next step on, and bind them to the attention backend; ``[]`` drops them. The list
        object :attr:`kv_caches` stays the same (its contents are replaced)."""
        self.kv_caches[:] = kv_caches
        self.attn_backend.bind_kv_caches(self.kv_caches)

    def release(self) -> None:
        """Drop the graphs and the KV caches (shutdown)."""
        if self.graph_runner is not None:
            self.graph_runner.release()
        self.bind_kv_caches([])

    # ---------------------------------------------------------------- capture
    def init_graph_runner(
        self,
        plan: GraphPlan,
        num_warmups: int,
        graph_opt_level: int,
        capture_logits: bool = False,
    ):
        """Create the (empty) graph runner of ``plan`` for this runner's model and backend; the
        capture loops below fill it during warm-up. ``capture_logits``: the decode graphs end
        with the logits and their argmax (``CudaGraphRunner``), which a decode step then samples
        from instead of launching the LM head and the argmax itself."""
        from fastdeploy.model_executor.graph_optimization.graph_runner import CudaGraphRunner

        self.graph_runner = CudaGraphRunner(
            self.model,
            self.attn_backend,
            plan,
            num_warmups,
            graph_opt_level,
            capture_logits=capture_logits,
        )
        return self.graph_runner

    def capture_model_prefill_and_mixed(self, progress=None) -> None:
        """Capture piecewise graphs for every prefill/mixed token bucket, largest first (warm-up
        only; :meth:`capture_prefill_bucket` each). ``progress`` (a tqdm bar) is advanced once
        per bucket."""
        for n in self.graph_runner.plan.prefill_capture_sizes:
            self.capture_prefill_bucket(n)
            if progress is not None:
                progress.update(1)

    def capture_prefill_bucket(self, n: int) -> None:
        """Capture the piecewise graphs of token bucket ``n`` from a dummy step of exactly ``n``
        tokens: one request, or several when ``n`` exceeds one request's block table. Every
        request writes its K/V into the null block (block 0, never handed out), so a capture
        between served steps leaves every live block alone."""
        # A request holds at most max_model_len tokens (positions stay in the RoPE cache); a
        # bucket (at most max_num_batched_tokens <= max_num_seqs * max_model_len tokens) then
        # needs at most max_num_seqs requests.
        buffers = self.buffers
        # One shared block: a bucket may need more blocks than a small pool has, and what
        # capture writes is never read as real KV.
        sched = dummy_step(
            split_tokens(n, buffers.max_seq_tokens),
            buffers.block_size,
            share_block=True,
            first_block=0,
        )
        inputs = buffers.prepare(sched, padded=n)
        meta = self.build_forward_meta(inputs)
        self.graph_runner.capture_piecewise(n, inputs.input_ids, inputs.positions, meta)

    def capture_decode_bucket(self, b: int) -> None:
        """Capture the full graph of decode bucket ``b``: ``b`` one-token requests with one
        token of history, sharing the null block (see :meth:`capture_prefill_bucket`)."""
        sched = dummy_step(
            [1] * b, self.buffers.block_size, history=1, share_block=True, first_block=0
        )
        inputs = self.buffers.prepare(sched, padded=b)
        meta = ForwardMeta(
            self.attn_backend, None, self.kv_caches, slot_mapping=inputs.batch.slot_mapping
        )
        self.graph_runner.capture_full_decode(
            b, inputs.input_ids, inputs.positions, inputs.batch, meta
        )

    def capture_sampled_bucket(self, rows: int) -> None:
        """Capture the sampled-row logits graph of ``rows`` rows (after a piecewise bucket)."""
        self.graph_runner.capture_sampled_logits(rows, self.buffers.logits_indices)

    def capture_task(self, task) -> None:
        """Capture one :class:`~fastdeploy.model_executor.graph_optimization.capture_order.
        CaptureTask` (its kind's method above).

        Raises:
            whatever the capture raises (out of memory, a CUDA error, an order error).
        """
        capture = {
            "prefill": self.capture_prefill_bucket,
            "decode": self.capture_decode_bucket,
            "sampled": self.capture_sampled_bucket,
        }[task.kind]
        capture(task.size)

    def capture_model(self, progress=None) -> None:
        """Capture a full graph for every decode bucket, largest first (warm-up only;
        :meth:`capture_decode_bucket` each). With the decode graphs' logits
        (``capture_logits``) and piecewise buckets, then the sampled rows' logits graph of each
        decode bucket size (a piecewise step samples at most one row a request)."""
        graphs = self.graph_runner
        for b in graphs.plan.decode_capture_sizes:
            self.capture_decode_bucket(b)
            if progress is not None:
                progress.update(1)
        if graphs.capture_logits and graphs.piecewise:  # piecewise steps' sampled rows
            for b in graphs.plan.decode_capture_sizes:  # <= max_num_seqs (FDConfig checks)
                self.capture_sampled_bucket(b)

    # ---------------------------------------------------------------- step
    def build_forward_meta(
        self, inputs: StepInputs, layer_events: list | None = None
    ) -> ForwardMeta:
        """Attention metadata is built here, once per step, never per layer. The layers store
        K/V with their RoPE through the step's slot mapping (:meth:`ForwardMeta.kv_store`)."""
        return ForwardMeta(
            attn_backend=self.attn_backend,
            attn_metadata=self.attn_backend.build_metadata(inputs.batch),
            kv_caches=self.kv_caches,
            layer_events=layer_events or None,
            slot_mapping=inputs.batch.slot_mapping,
        )

    def dispatch(self, sched: SchedulerOutput) -> tuple[str, int | None]:
        """The step's ``(mode, bucket)`` from host data: ``full``/``piecewise`` with the bucket
        to replay, or ``("eager", None)`` (always without graphs, and while the plan's bucket
        for the step is not captured: :attr:`capture_progress`). Under tensor parallelism
        rank 0 decides it and sends it with the step, so the ranks never disagree."""
        if self.graph_runner is None:
            return "eager", None
        mode, bucket = self.graph_runner.plan.dispatch(
            sched.is_decode_only, len(sched.scheduled), sched.num_batched_tokens
        )
        progress = self.capture_progress
        if progress is not None and not progress.is_ready(mode, bucket):
            return "eager", None  # its graph is not captured (yet, or its capture failed)
        return mode, bucket

    def execute_model(
        self,
        sched: SchedulerOutput,
        dispatch: tuple[str, int | None] | None = None,
        layer_events: list | None = None,
    ) -> dict[str, SampledToken]:
        """Run one step and wait for its tokens: :meth:`execute_model_async`, then its
        ``result()``.

        Returns:
            request id -> sampled token, for the requests with ``ScheduledRequest.samples``;
            empty on a rank that is not the driver.
        """
        return self.execute_model_async(sched, dispatch, layer_events).result()

    @torch.inference_mode()
    def execute_model_async(
        self,
        sched: SchedulerOutput,
        dispatch: tuple[str, int | None] | None = None,
        layer_events: list | None = None,
    ) -> PendingOutput:
        """Queue one step and the copy of its sampled tokens; returns without waiting for the
        device (no host sync on CUDA: inputs go through pinned buffers, and a placeholder token
        of the previous step is fed on the device).

        Call it for every scheduled step, empty ones included: the requests of
        ``sched.finished_request_ids`` give back their sampling state here. Preempted requests
        keep theirs (seeded generator, penalty counts) until they finish.

        Args:
            sched: the step.
            dispatch: the ``(mode, bucket)`` rank 0 chose (:meth:`dispatch`); None decides here.
            layer_events: host-tier swap-ins of this step (``swap_in_mode=layerwise``): one
                event per layer, that layer's copies; see :meth:`forward`.

        Returns:
            The step's :class:`~fastdeploy.worker.async_output.PendingOutput`: its
            ``result()`` waits on the step's one event and gives request id -> sampled token
            for the requests with ``ScheduledRequest.samples`` (empty on a rank that is not the
            driver), and its ``prompt_logprobs`` (the rows of requests that asked for prompt
            logprobs, :mod:`~fastdeploy.worker.prompt_logprobs`; None in a step without any).
        """
        for rid in sched.finished_request_ids:
            self.sampling.free(rid)
        if sched.is_empty:
            return PendingOutput.ready({})
        hidden, inputs, mode = self.forward(sched, dispatch, layer_events)
        # Prompt logprobs: only the rows of requests that asked, eagerly, outside any graph.
        plan = plan_prompt_logprobs(sched) if self.is_driver else None
        prompt_lp = None
        if plan is not None:
            prompt_lp = compute_prompt_logprobs(self.model.compute_logits, hidden, plan)
        pending = self._sample(sched, hidden, inputs, mode)
        pending.prompt_logprobs = prompt_lp
        return pending

    def _sample(
        self, sched: SchedulerOutput, hidden: torch.Tensor, inputs: StepInputs, mode: str
    ) -> PendingOutput:
        """The sampled rows' logits (from the step's graphs where captured, else the LM head on
        ``hidden``), sampling, and the queued copy of the tokens (see
        :meth:`execute_model_async`)."""
        self.last_sampled = None
        if not inputs.sampling_reqs:
            return PendingOutput.ready({})
        # Under tensor parallelism every rank computes the logits: the LM head all-gathers them.
        # A decode step whose rows all sample takes them in order: a slice, no gather kernel (a
        # one-token prefill chunk that is not the prompt's end is a decode-only row that does
        # not sample). A full graph captured with its logits has every row's already; a
        # piecewise step's sampled rows come from a graph of their own, in order.
        num_sampling = len(inputs.sampling_reqs)
        every_row = inputs.batch.is_decode_only and num_sampling == inputs.batch.num_reqs
        tail, in_order = None, every_row
        if mode == "full":
            tail = self.graph_runner.decode_logits(inputs.padded)
        elif mode == "piecewise":
            tail, in_order = self.graph_runner.sampled_logits(num_sampling), True
        argmax = None
        if tail is not None:
            if in_order:
                logits, argmax = tail[0][:num_sampling], tail[1][:num_sampling]
            else:
                logits = tail[0].index_select(0, inputs.logits_indices)
                argmax = tail[1].index_select(0, inputs.logits_indices)
        else:
            rows = hidden[:num_sampling] if every_row else hidden[inputs.logits_indices]
            logits = self.model.compute_logits(rows)
        if not self.is_driver:
            return PendingOutput.ready({})
        scheduled = sched.scheduled  # the requests that sample, as prepare() found them
        reqs = [scheduled[i].request for i in inputs.sampling]
        bitmask = sched.grammar_bitmask
        if callable(bitmask):  # deferred: built now, while the device runs this step's forward
            bitmask = bitmask()
        if bitmask is not None:
            logits = self.grammar_mask.apply(logits, bitmask)
            argmax = None  # the masked logits have an argmax of their own
        out = self.sampler(logits, self.sampling.prepare(reqs, logits.shape[-1]), argmax)
        self.sampling.record(reqs, out.token_ids)
        rows = dict(zip(inputs.sampling_reqs, range(num_sampling)))
        self.last_sampled = LastSampled(out.token_ids, rows)
        return self.outputs.stage(out, inputs.sampling_reqs)

    def forward(
        self,
        sched: SchedulerOutput,
        dispatch: tuple[str, int | None] | None = None,
        layer_events: list | None = None,
    ) -> tuple[torch.Tensor, StepInputs, str]:
        """Prepare ``sched`` in the persistent buffers and run it: a captured graph when the
        plan's dispatch picks one (host data only, no device sync), else eagerly.

        Args:
            sched: the step.
            dispatch: ``(mode, bucket)`` decided by rank 0 (:meth:`dispatch`); None decides here.
            layer_events: one event per layer (``Event.wait()`` makes the current stream wait):
                eagerly, each layer waits on its own event before its KV store
                (``ForwardMeta.kv_store``); before
                a graph replay, which cannot wait inside, the stream waits on all of them. No
                host sync either way.

        Returns:
            ``(hidden [padded, H], inputs, mode)``; rows past ``inputs.num_tokens`` are padding,
            ``mode`` is ``full``, ``piecewise`` or ``eager``.
        """
        graphs = self.graph_runner
        mode, bucket = dispatch if dispatch is not None else self.dispatch(sched)
        if mode != "eager" and graphs is None:
            raise RuntimeError(f"step dispatched to a {mode} graph, but this rank has no graphs")
        inputs = self.buffers.prepare(sched, padded=bucket, last_sampled=self.last_sampled)
        if layer_events and mode != "eager":
            for event in layer_events:
                event.wait()
        if mode == "full":
            hidden = graphs.replay_full(bucket, inputs.input_ids, inputs.batch)
        elif mode == "piecewise":
            meta = self.build_forward_meta(inputs)
            hidden = graphs.replay_piecewise(bucket, inputs.input_ids, meta)
        else:
            meta = self.build_forward_meta(inputs, layer_events)
            hidden = self.model(inputs.input_ids, inputs.positions, meta)
        self.steps_by_mode[mode] += 1
        self.num_padded_tokens += inputs.padded - inputs.num_tokens
        return hidden, inputs, mode
