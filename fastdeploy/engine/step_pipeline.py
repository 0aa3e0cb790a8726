"""The engine's step pipeline, with or without the overlap schedule (SGLang's overlap scheduler,
vLLM's async scheduling): :class:`StepPipeline`, owned by
:class:`~fastdeploy.engine.engine.LLMEngine`.

A step is launched, then finished:

* launch: the worker queues the forward, the sampling and ONE copy of the sampled tokens to
  pinned host memory (:class:`~fastdeploy.worker.async_output.PendingOutput`) and returns at once;
  the scheduler applies the step's counters at once (:meth:`Scheduler.advance`): each request
  that samples counts a placeholder for its token.
* finish: the host waits on the step's event (its only wait), the placeholders become tokens
  (:meth:`Scheduler.resolve`), the stop checker runs and the outputs are built.

Without the overlap schedule a step is finished right after its launch. With it, ``step()``
launches step N and then finishes step N-1, so the host schedules, prepares and launches N while
the device still runs N-1, and reads N-1's tokens while the device runs N. A request that decodes
in N-1 and N gets its N-1 token in N's input on the device (the runner scatters it from N-1's
sampled tokens), and the host learns it one step later. What that costs, and how it stays
correct:

* a request that N-1's token ends (eos, a stop string or token) was scheduled into N: its N token
  is computed and dropped (never appended or emitted), and its blocks are freed when N-1
  finishes (the device writes them in stream order, before any later step reuses them);
  ``min_tokens`` counts the placeholders, and the penalty counts are kept on the device;
* a request that N-1's token ends by length is not scheduled into N (the scheduler asks the
  length rule with its placeholders), so ``max_tokens`` wastes nothing;
* a request aborted or preempted meanwhile: its token is dropped (aborted) or kept (preempted: it
  was sampled from the whole context, and it re-prefills with the rest);
* a seeded request draws from its own generator once per sampled token, so its tokens are the
  same with the overlap schedule on or off;
* a structured-output request: step N's grammar mask needs the matcher to have accepted N-1's
  token, which only the host knows after N-1 finishes. So a step that samples a request with a
  grammar launches with a *deferred* mask (``grammar_bitmask`` a callable): the runner queues
  N's forward first, and only then, just before the sampler, calls it; it waits for the step in
  flight's tokens, feeds them to the matchers (:meth:`StructuredOutputs.accept_early`) and
  fills N's mask while the device already runs N's forward. The step in flight is still
  finished after the launch, as always (so a request that N-1's token ends is dropped from N as
  above). The wait is a host sync in that step only, taken after its forward was queued: the
  device idles only while the host fills the masks and queues the sampler. A step without a
  grammar request launches as before, with no sync and no bitmask (``grammar_bitmask`` None);
  without a step in flight the mask is built at once (a tensor).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from fastdeploy.cache_manager.host_tier import HostTier
from fastdeploy.core.outputs import EngineOutput
from fastdeploy.core.request import Request
from fastdeploy.core.scheduler_output import SchedulerOutput
from fastdeploy.engine.structured_output import StructuredOutputs
from fastdeploy.scheduler.scheduler import Scheduler
from fastdeploy.worker.async_output import PendingOutput


@dataclass
class LaunchedStep:
    """A step queued on the device whose tokens the host has not read yet.

    Attributes:
        output: the worker's handle on the step's sampled tokens.
        samplers: the requests that sample in the step, in row order (from
            :meth:`Scheduler.advance`).
    """

    output: PendingOutput
    samplers: list[Request]


#: ``token_output(request, token_id, logprobs, now)``: the engine's stop check and output of a
#: request's new (already appended) token.
TokenOutput = Callable[[Request, int, list[dict] | None, float], EngineOutput]


class StepExecutor(Protocol):
    """What the pipeline needs of a worker: a step queued on the device, its tokens read later."""

    def execute_model_async(
        self, sched: SchedulerOutput, layer_events: list | None = None
    ) -> PendingOutput: ...


class StepPipeline:
    """The launch and finish halves of :meth:`LLMEngine.step` (see the module docstring).

    Args:
        worker: runs a step (:class:`StepExecutor`).
        scheduler: applies a step's counters at launch (:meth:`Scheduler.advance`) and its
            tokens at finish (:meth:`Scheduler.resolve`).
        host_tier: the host KV tier, or None (its copies in flight keep the engine stepping).
        overlap_schedule: the plan's rule 10: launch step N before finishing step N-1.
        grammars: the structured-output matchers
            (:class:`~fastdeploy.engine.structured_output.StructuredOutputs`), or None.

    Attributes:
        in_flight: the launched step whose tokens the host has not read (overlap schedule), or
            None.
        last_step_idle: whether the last :meth:`run` launched and finished nothing while no
            host-tier copy was in flight.
    """

    def __init__(
        self,
        worker: StepExecutor,
        scheduler: Scheduler,
        host_tier: HostTier | None,
        overlap_schedule: bool,
        grammars: StructuredOutputs | None = None,
    ) -> None:
        self.grammars = grammars
        self.worker = worker
        self.scheduler = scheduler
        self.host_tier = host_tier
        self.overlap_schedule = overlap_schedule
        self.in_flight: LaunchedStep | None = None
        self.last_step_idle = False

    def run(
        self, sched: SchedulerOutput, layer_events: list | None, token_output: TokenOutput
    ) -> list[EngineOutput]:
        """Launch ``sched`` and finish the step that is due: ``sched`` itself, or under the
        overlap schedule the previous step (``sched`` stays in flight). Returns the due step's
        outputs (none when no step is due), each built by ``token_output`` (the engine's; given
        per call, so the pipeline holds no reference to the engine)."""
        grammars = self.grammars
        if grammars is not None and grammars.alive and not sched.is_empty:
            flight = self.in_flight
            if flight is not None and self._samples_grammar(sched):
                # The masks of sched need the in-flight tokens accepted (module docstring): the
                # runner calls this after queueing sched's forward; finish() stays after launch.
                sched.grammar_bitmask = functools.partial(self._late_bitmask, flight, sched)
            else:
                sched.grammar_bitmask = grammars.bitmask(sched)
        launched = self.launch(sched, layer_events)
        if self.overlap_schedule:
            due, self.in_flight = self.in_flight, launched
        else:
            due = launched
        host = self.host_tier
        # Copies in flight are polled by stepping: not idle until they landed.
        self.last_step_idle = (
            launched is None and due is None and not (host is not None and host.has_work)
        )
        return self.finish(due, token_output) if due is not None else []

    def _late_bitmask(self, flight: LaunchedStep, sched: SchedulerOutput) -> Any:
        """The deferred mask of ``sched`` (called once, by the runner, after ``sched``'s forward
        was queued): wait for ``flight``'s tokens, feed them to the matchers, fill the rows."""
        self.grammars.accept_early(flight.samplers, flight.output.token_ids())
        return self.grammars.bitmask(sched)

    def _samples_grammar(self, sched: SchedulerOutput) -> bool:
        has = self.grammars.has_grammar
        return any(s.samples and has(s.request.request_id) for s in sched.scheduled)

    def launch(self, sched: SchedulerOutput, layer_events: list | None) -> LaunchedStep | None:
        """Queue ``sched`` on the worker and apply its counters; None for an empty step (which
        still reaches the worker: the runner frees the sampling state of finished requests)."""
        if layer_events:
            output = self.worker.execute_model_async(sched, layer_events=layer_events)
        else:
            output = self.worker.execute_model_async(sched)
        if sched.is_empty:
            return None
        return LaunchedStep(output, self.scheduler.advance(sched))

    def finish(self, step: LaunchedStep, token_output: TokenOutput) -> list[EngineOutput]:
        """Wait for ``step``'s tokens, append them, and build the outputs with
        ``token_output`` (which stop-checks)."""
        token_ids = step.output.token_ids()  # no per-row objects unless logprobs were asked
        if step.output.prompt_logprobs is not None:  # before the tokens: a first output sends them
            self._take_prompt_logprobs(step.output.prompt_logprobs.entries())
        now = time.monotonic()
        outputs = []
        for request in self.scheduler.resolve(step.samplers, token_ids):
            token_id = token_ids[request.request_id]
            logprobs = None
            k = request.sampling_params.logprobs
            if k is not None:
                tok = step.output.result()[request.request_id]
                top = (tok.top_logprobs or [])[:k]
                logprobs = [{"token_id": token_id, "logprob": tok.logprob, "top_logprobs": top}]
                request.output_logprobs.extend(logprobs)
            outputs.append(token_output(request, token_id, logprobs, now))
        return outputs

    def _take_prompt_logprobs(self, entries: dict[str, list[dict]]) -> None:
        """Append a finished step's prompt logprobs to their requests, in position order (steps
        finish in launch order and never score a position twice). A request aborted or finished
        since the launch is gone from the scheduler: its entries are dropped; one preempted since
        keeps them (they were computed from its whole context)."""
        get = self.scheduler.get_request
        for rid, new in entries.items():
            request = get(rid)
            if request is not None and request.prompt_logprobs is not None:
                request.prompt_logprobs.extend(new)
