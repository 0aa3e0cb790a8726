"""Continuous batching with chunked prefill under a per-step token budget.

Each step (:meth:`Scheduler.schedule`) spends at most ``max_num_batched_tokens`` tokens on at most
``max_num_seqs`` running requests:

1. Running requests first, in admission order. Each gets ``num_tokens - num_computed_tokens``
   tokens (1 for a decode, the rest of its prompt for one mid chunked prefill), capped by the
   remaining budget. Under the overlap schedule a step is applied as it is launched
   (:meth:`Scheduler.advance`) and its tokens arrive one step later (:meth:`Scheduler.resolve`):
   a token still in flight counts as a placeholder, so a decode computes it (its id is fed on
   the device), and a request that its token in flight ends by length is not scheduled.
2. Then waiting requests, first come first served (FIFO, no overtaking), while the budget,
   ``max_num_seqs`` and free KV blocks allow; the prefix cache is looked up on admission.
   With ``scheduler_delay_factor`` f > 0 (vLLM's ``--scheduler-delay-factor`` and its V0
   scheduler's rule), while any request runs, waiting requests are admitted only once the
   oldest has waited more than f times the last prompt latency: the interval from the
   ``schedule()`` call that last admitted a prompt to the next call (about one step; taken only
   while a request runs, so an idle engine's wait never counts). Prompts that arrive a few
   steps apart (a closed loop of clients, each sending its next request when the last one ends)
   then share one mixed prefill step instead of paying for one each, at the price of that wait
   in their time to first token; with nothing running they are admitted at once, and a PD
   decode node's requests (no prefill here) are never held.

Memory policy:
  * Admission: a waiting request is admitted only when the KV blocks for its scheduled tokens can
    be allocated now (counting evictable prefix-cached blocks as free); otherwise it and everyone
    behind it wait. No waiting request is admitted in a step that had to preempt.
  * Preemption by recompute: when a running request cannot get a block, the most recently admitted
    running request is preempted: its blocks are freed (full blocks may survive in the prefix
    cache), its counters reset, and it goes to the FRONT of the waiting queue. On re-admission it
    re-prefills its prompt plus the tokens it had generated (no swapping to host memory).
  * Prefill/decode disaggregation, decode node: a waiting request whose prompt KV lives on a
    prefill node (``request.remote_prefill``) is admitted, FIFO like the others, by allocating
    blocks for its whole prompt (after its own prefix-cache lookup) without spending step budget;
    it then waits in ``WAITING_FOR_REMOTE_KV``, holding its blocks and never scheduled, until the
    engine reports the pull done (:meth:`remote_kv_loaded`: it runs from its first decode step)
    or failed (:meth:`remote_kv_failed`). Aborting it while the pull may still write parks its
    blocks (:meth:`release_cancelled` frees them once the pull ended).
  * Host KV tier (``host_tier``): admission continues the device prefix hit on the host; the host
    hits get device blocks, all or nothing together with the new tokens, and are swapped in.
    With ``swap_in_mode=request`` the request then waits in ``WAITING_FOR_SWAP_IN``, holding its
    blocks, never scheduled and spending no step budget, until the engine reports its copy
    landed (:meth:`swap_in_landed`); aborted meanwhile, its blocks are parked until then. With
    ``layerwise`` it runs at once: the forward waits for each layer's copy. Preemption still
    recomputes, but re-admission finds the blocks that were written through to the host.
  * A request alone in the pool always fits when ``max_model_len`` is at most the pool's tokens,
    which the engine guarantees at start-up (``fit_max_model_len`` in
    :mod:`fastdeploy.cache_manager.kv_cache_manager`): a prompt that could never fit is refused
    at admission, and a running request that outgrows the free blocks preempts the newer ones (or
    itself) and resumes when blocks free up. Given a larger ``max_model_len``, the one request left
    running may find no block: :class:`InsufficientKVCacheError` is raised then, a broken
    invariant that the engine does not paper over.
"""

from __future__ import annotations

import time
from collections import deque

from fastdeploy.cache_manager.host_tier import HostTier
from fastdeploy.cache_manager.kv_cache_manager import KVCacheManager
from fastdeploy.config import SchedulerConfig, check
from fastdeploy.core.request import Request, RequestStatus, check_prompt_length
from fastdeploy.core.scheduler_output import ScheduledRequest, SchedulerOutput
from fastdeploy.scheduler import step_output
from fastdeploy.scheduler.integrity import check_integrity
from fastdeploy.scheduler.remote_kv import RemoteKVQueue
from fastdeploy.scheduler.swap_in import SwapInQueue


class InsufficientKVCacheError(RuntimeError):
    """A request needs more KV blocks than the whole pool holds (only possible when
    ``max_model_len`` exceeds the pool; see the module docstring).

    ``request_id`` names it; the scheduler's state stays consistent (the request is still
    running and holds its blocks).
    """

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(message)
        self.request_id = request_id


class Scheduler:
    """Continuous-batching scheduler over a :class:`KVCacheManager` (host only, no device).

    Args:
        scheduler_config: ``max_num_seqs``, ``max_num_batched_tokens`` (tokens per step, an
            integer already resolved by ``EngineArgs.create_engine_config``, which owns its
            default) and ``enable_chunked_prefill``.
        kv_cache_manager: owns the KV blocks.
        max_model_len: most tokens (prompt + output) of one request.
        host_tier: the host KV tier over ``kv_cache_manager``, or None.
        clock: seconds, the clock of ``Request.arrival_time`` (``time.monotonic``); the delay
            factor reads it.

    Attributes:
        remote_kv: the decode-leg requests whose prompt KV is pulled (PD decode node).
        swap_in: the requests whose host-tier hits are copied in (``swap_in_mode=request``).

    Raises:
        ValueError: ``max_model_len < 1``; ``max_num_batched_tokens`` not a resolved integer
            (``None``: build the config with ``EngineArgs.create_engine_config``); or chunked
            prefill off and a token budget below ``max_model_len`` (a long prompt could never be
            scheduled).
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        max_model_len: int,
        host_tier: HostTier | None = None,
        clock=time.monotonic,
    ) -> None:
        if not isinstance(max_model_len, int) or max_model_len < 1:
            raise ValueError(
                f"max_model_len={max_model_len!r} is invalid; allowed: an integer >= 1"
            )
        self.enable_chunked_prefill = scheduler_config.enable_chunked_prefill
        budget = scheduler_config.max_num_batched_tokens
        check(
            isinstance(budget, int) and not isinstance(budget, bool),
            "max_num_batched_tokens",
            budget,
            "a resolved integer (build the config with EngineArgs.create_engine_config)",
        )
        if not self.enable_chunked_prefill and budget < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={budget} is invalid with enable_chunked_prefill=False; "
                f"allowed: >= max_model_len ({max_model_len}), so a whole prompt fits one step"
            )
        self.max_num_batched_tokens = budget
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.delay_factor = float(scheduler_config.scheduler_delay_factor)
        self.clock = clock
        self._prev_time = 0.0  # the last schedule() call (clock seconds)
        self._prev_prompt = False  # whether it admitted a prompt
        self._last_prompt_latency = 0.0  # seconds from that call to the one after it
        self.max_model_len = max_model_len
        self.kv_cache_manager = kv_cache_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last one is preempted first
        self._requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []
        self._unreported_preempted: list[Request] = []  # preempted by a call that raised
        #: Preemptions by recompute since start (a request preempted twice counts twice).
        self.num_preemptions = 0
        self.remote_kv = RemoteKVQueue(kv_cache_manager)
        self.swap_in = SwapInQueue(kv_cache_manager, host_tier)

    @property
    def num_running(self) -> int:
        """Requests admitted and holding KV blocks."""
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Requests queued for admission, preempted ones included."""
        return len(self.waiting)

    @property
    def num_waiting_for_remote_kv(self) -> int:
        """Decode-leg requests holding blocks while their KV is pulled."""
        return len(self.remote_kv)

    @property
    def num_waiting_for_swap_in(self) -> int:
        """Requests holding blocks while their host-tier hits are copied back."""
        return len(self.swap_in)

    @property
    def num_cancelled_loads(self) -> int:
        """Aborted decode-leg requests whose blocks wait for their pull to end."""
        return self.remote_kv.num_cancelled

    @property
    def num_cancelled_swap_ins(self) -> int:
        """Aborted requests whose blocks wait for their swap-in to land."""
        return self.swap_in.num_cancelled

    @property
    def request_ids(self):
        """The ids of the unfinished requests (a live view)."""
        return self._requests.keys()

    def has_unfinished_requests(self) -> bool:
        """True while a request is waiting, running, or waiting for its remote KV or swap-in."""
        return bool(self.waiting or self.running or len(self.remote_kv) or len(self.swap_in))

    def get_request(self, request_id: str) -> Request | None:
        """The waiting or running request with this id, or ``None``."""
        return self._requests.get(request_id)

    def add_request(self, request: Request) -> None:
        """Queue a new request at the back of the waiting queue.

        Raises:
            ValueError: duplicate id; a prompt refused by
                :func:`~fastdeploy.core.request.check_prompt_length` (empty, or not shorter than
                ``max_model_len``; the message names the request); or a request that is not fresh
                (not WAITING, or holding output tokens, blocks or computed tokens).
        """
        rid = request.request_id
        if rid in self._requests:
            raise ValueError(f"request id {rid!r} is already scheduled")
        if self.remote_kv.is_cancelled(rid):
            raise ValueError(
                f"request id {rid!r} is invalid: an aborted request with this id still waits for "
                "its KV pull to stop; allowed: a fresh id"
            )
        try:
            check_prompt_length(request.num_prompt_tokens, self.max_model_len)
        except ValueError as e:
            raise ValueError(f"request {rid!r}: {e}") from None
        fresh = request.status == RequestStatus.WAITING and not request.num_computed_tokens
        if not fresh or request.block_ids or request.output_token_ids:
            raise ValueError(f"request {rid!r} is not fresh (status {request.status.value})")
        self._requests[rid] = request
        self.waiting.append(request)

    def abort_request(self, request_id: str) -> bool:
        """Abort a waiting or running request: free its blocks now, status FINISHED_ABORTED.

        Its id is reported in the next output's ``finished_request_ids``. Returns False when no
        unfinished request has this id.
        """
        request = self._requests.get(request_id)
        if request is None:
            return False
        if request.status == RequestStatus.WAITING_FOR_REMOTE_KV:
            self.remote_kv.cancel(request)  # a pull may still write: parked until it ended
        elif request.status == RequestStatus.WAITING_FOR_SWAP_IN:
            self.swap_in.cancel(request)  # host hits still copied in: parked until they landed
        else:
            self._remove(request, RequestStatus.FINISHED_ABORTED)
            return True
        del self._requests[request_id]
        request.status = RequestStatus.FINISHED_ABORTED
        request.finish_time = time.monotonic()
        self._finished_ids.append(request_id)
        return True

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """The engine decided ``request`` stopped: free its blocks and set ``status``.

        Its id is reported in the next output's ``finished_request_ids``.

        Raises:
            ValueError: ``status`` is not a finished state, or the request is not scheduled here.
        """
        if not status.finished:
            raise ValueError(f"status={status} is invalid; allowed: a finished status")
        if self._requests.get(request.request_id) is not request:
            raise ValueError(f"request {request.request_id!r} is not waiting or running")
        self._remove(request, status)

    # ------------------------------------------------------------ step outputs
    def update_from_output(
        self, output: SchedulerOutput, sampled_token_ids: dict[str, int]
    ) -> list[Request]:
        """Apply a finished step: :meth:`advance`, then :meth:`resolve` at once (the step loop
        without the overlap schedule).

        Args:
            output: what :meth:`schedule` returned for the step.
            sampled_token_ids: request id -> token id, exactly for the scheduled requests whose
                ``samples`` is true (requests aborted since may be present or not).

        Returns the requests that got a new token, in scheduled order; the engine checks their stop
        conditions and calls :meth:`finish_request`. Requests aborted since :meth:`schedule` are
        skipped.

        Raises:
            ValueError: a sampling request has no token, a token is given for a request that does
                not sample, or the output was already applied (nothing is changed then).
        """
        live = step_output.check_sampled(output, sampled_token_ids)
        return self.resolve(self.advance(live), sampled_token_ids)

    def advance(self, output: SchedulerOutput) -> list[Request]:
        """Apply a step as it is launched, before its tokens are known: advance each request's
        computed tokens (and its prompt-logprob rows), cache the full blocks of known tokens,
        and count one output placeholder per request that samples (the overlap schedule then
        schedules the next step from these counters while this one runs; :meth:`resolve`
        replaces the placeholders).

        Args:
            output: what :meth:`schedule` returned for the step (every request running).

        Returns:
            The requests that sample in the step, in scheduled order (pass them to
            :meth:`resolve`).

        Raises:
            ValueError: the step was already applied (nothing is changed then).
        """
        return step_output.advance(output, self.kv_cache_manager)

    def resolve(self, samplers: list[Request], sampled_token_ids: dict[str, int]) -> list[Request]:
        """A launched step's tokens arrived: each sampler's oldest placeholder becomes its token
        (appended to ``output_token_ids``), and the blocks it completes are cached.

        A request finished or aborted since :meth:`advance` is skipped: its token is dropped,
        never appended or emitted. A request preempted since keeps its token (it was sampled
        from its whole context) and re-prefills it with the rest.

        Args:
            samplers: what :meth:`advance` returned for the step.
            sampled_token_ids: request id -> token id, for at least the samplers still here.

        Returns:
            The requests that got a token, in ``samplers`` order; the engine checks their stop
            conditions.

        Raises:
            ValueError: a sampler still here has no token, or none pending (resolved twice).
        """
        return step_output.resolve(
            samplers, sampled_token_ids, self._requests, self.kv_cache_manager
        )

    # ------------------------------------------------------------ remote KV and swap-in
    def take_new_remote_loads(self) -> list[Request]:
        """Requests that entered ``WAITING_FOR_REMOTE_KV`` since the last call (the engine
        starts their pulls)."""
        return self.remote_kv.take_new()

    def remote_kv_loaded(self, request_id: str, first_token_id: int | None) -> Request | None:
        """The prompt's KV landed: the prompt counts as computed (its full blocks are cached),
        the prefill node's first token is appended, and the request runs from its next step.
        With ``first_token_id=None`` the last prompt token counts as not computed, so the next
        step recomputes it and samples the first token here. Returns the request, or None when
        it is no longer waiting (aborted meanwhile)."""
        request = self.remote_kv.loaded(request_id, first_token_id)
        if request is not None:
            self.running.append(request)
        return request

    def remote_kv_failed(self, request_id: str, recompute: bool) -> Request | None:
        """The pull failed. With ``recompute`` the request drops its blocks (none were cached)
        and goes to the front of the waiting queue as a local request (it prefills here);
        otherwise it stays out of every queue for the engine to finish. Returns the request, or
        None when it is no longer waiting."""
        request = self.remote_kv.failed(request_id, recompute)
        if request is None:
            return None
        if recompute:
            self.waiting.appendleft(request)
        else:
            self.running.append(request)  # so that finish_request() removes it as usual
        return request

    def release_cancelled(self, request_id: str) -> bool:
        """The pull of an aborted request ended: free its parked blocks. False if unknown."""
        return self.remote_kv.release_cancelled(request_id)

    def swap_in_landed(self, request: Request) -> None:
        """The host-tier copies into ``request``'s blocks landed. A request waiting for them
        runs from its next step (the swapped-in blocks enter the device prefix cache); one
        aborted meanwhile frees its parked blocks now; for any other (``layerwise``: already
        running or finished) nothing changes."""
        if self.swap_in.landed(request):
            self.running.append(request)

    def check_integrity(self, other_holders: list[list[int]] | None = None) -> None:
        """:func:`~fastdeploy.scheduler.integrity.check_integrity` of this scheduler.

        Raises:
            AssertionError: naming the first broken invariant.
        """
        check_integrity(self, other_holders)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and token counts; allocate their KV blocks.

        Returns running requests first, then newly admitted (or resumed) ones; ``preempted``
        lists the requests preempted in this call; ``finished_request_ids`` those that finished
        or were aborted since the last call.

        Raises:
            InsufficientKVCacheError: the only running request cannot get a block.
            RuntimeError: a running request has no token left to compute (a missed update).
        """
        hold = self._hold_waiting()  # times every call, preempting ones included
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        running, max_model_len = self.running, self.max_model_len
        allocate = self.kv_cache_manager.allocate_slots
        i = 0
        try:
            while i < len(running) and budget > 0:
                request = running[i]
                pending = request.num_output_placeholders
                if pending and request.reaches_length_limit(max_model_len, pending):
                    i += 1  # its token in flight ends it (overlap schedule): nothing to compute
                    continue
                computed = request.num_computed_tokens
                num_new = min(request.num_tokens_with_placeholders - computed, budget)
                if num_new <= 0:
                    raise RuntimeError(
                        f"running request {request.request_id!r} has no token to compute; was "
                        "update_from_output skipped or finish_request not called?"
                    )
                # allocate_slots first: it succeeds for nearly every request (changing nothing
                # when it fails), and _allocate_or_preempt starts by calling it again.
                if not allocate(request, num_new) and not self._allocate_or_preempt(
                    request, num_new, preempted
                ):
                    break  # it preempted itself: it was the last running request
                scheduled.append(ScheduledRequest(request, computed, num_new))
                budget -= num_new
                i += 1
        except Exception:
            self._unreported_preempted.extend(preempted)  # report them with the next output
            raise
        if not preempted and not hold:
            admitted = self._admit_waiting(budget)
            self._prev_prompt = bool(admitted)  # a prefill runs in this step
            scheduled.extend(admitted)
        preempted = self._unreported_preempted + preempted
        self._unreported_preempted = []
        finished, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(
            scheduled=scheduled, preempted=preempted, finished_request_ids=finished
        )

    def _hold_waiting(self) -> bool:
        """Whether ``scheduler_delay_factor`` holds the waiting requests in this call (see the
        module docstring; vLLM V0's ``_passed_delay``, negated). Also times the last prompt
        latency: the interval from the call that admitted a prompt to this one, recorded only
        when a request still runs (an interval that ends an idle engine's wait is no step).
        A PD decode node's request (its prompt's KV is pulled, it runs no prefill here) is
        never held."""
        if self.delay_factor <= 0:
            return False
        now = self.clock()
        if self._prev_prompt and self.running:
            self._last_prompt_latency = now - self._prev_time
        self._prev_time, self._prev_prompt = now, False
        if not self.waiting or not self.running or self.waiting[0].remote_prefill is not None:
            return False
        oldest = self.waiting[0].arrival_time  # FIFO; preempted requests, older, go in front
        return not now - oldest > self.delay_factor * self._last_prompt_latency

    def _allocate_or_preempt(
        self, request: Request, num_new_tokens: int, preempted: list[Request]
    ) -> bool:
        """Allocate blocks for ``request``, preempting the newest running requests as needed.

        Returns False when ``request`` itself had to be preempted (it was the newest).
        """
        kv = self.kv_cache_manager
        while not kv.allocate_slots(request, num_new_tokens):
            victim = self.running[-1]
            need = kv.num_blocks_for(request.num_computed_tokens + num_new_tokens)
            if victim is request and len(self.running) == 1 and need > kv.num_usable_blocks:
                raise InsufficientKVCacheError(
                    request.request_id,
                    f"request {request.request_id!r} needs {need} KV blocks of {kv.block_size} "
                    f"tokens but only {len(request.block_ids) + kv.num_free_blocks} of "
                    f"{kv.num_usable_blocks} are available with nothing else running; raise "
                    "num_gpu_blocks_override / gpu_memory_utilization or lower max_model_len",
                )
            # Preempting the last running request itself is right when the blocks it lacks are
            # held outside the running batch (decode-leg requests waiting for their KV, a
            # prefill node's pending sends): it resumes once they are released.
            self.preempt(victim)
            preempted.append(victim)
            if victim is request:
                return False
        return True

    def preempt(self, request: Request) -> None:
        """Preempt a running request by recompute (the memory policy; :meth:`schedule` calls
        this when a running request cannot get a block): free its blocks, reset its counters and
        requeue it at the front of the waiting queue. A token still in flight is kept (see
        :meth:`resolve`).

        Raises:
            ValueError: ``request`` is not running.
        """
        self.running.remove(request)
        self.kv_cache_manager.free(request)
        request.num_computed_tokens = 0
        request.num_cached_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _admit_waiting(self, budget: int) -> list[ScheduledRequest]:
        """Admit waiting requests FIFO within ``budget`` tokens, ``max_num_seqs`` and the blocks."""
        kv = self.kv_cache_manager
        admitted = []
        while (
            self.waiting
            and budget > 0
            and len(self.running) + len(self.remote_kv) + len(self.swap_in) < self.max_num_seqs
        ):
            request = self.waiting[0]
            if request.num_output_placeholders:
                break  # preempted with a token in flight: re-prefill once it is known (FIFO)
            kv.get_computed_blocks(request)  # sets num_cached_tokens and num_computed_tokens
            if request.remote_prefill is not None:  # PD decode node: blocks now, KV pulled
                if not kv.allocate_slots(request, request.num_tokens - request.num_computed_tokens):
                    self._undo_admission(request)
                    break
                self.waiting.popleft()
                _note_first_admission(request)
                self.remote_kv.admit(request)
                continue
            host_hits = self.swap_in.lookup(request)
            host_tokens = len(host_hits) * kv.block_size
            num_new = request.num_tokens - request.num_computed_tokens - host_tokens
            if num_new > budget:
                if not self.enable_chunked_prefill and budget < self.max_num_batched_tokens:
                    self._undo_admission(request)  # wait for a step with room for the whole prompt
                    break
                # A chunk of the budget. Without chunked prefill only a request longer than an
                # empty step gets here (grown past max_model_len): chunk it rather than starve it.
                num_new = budget
            if not kv.allocate_slots(request, host_tokens + num_new):
                self._undo_admission(request)
                break
            self.waiting.popleft()
            waits = bool(host_hits) and self.swap_in.start(request, host_hits)
            _note_first_admission(request)
            if waits:
                continue  # waits in WAITING_FOR_SWAP_IN, spending no budget
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            admitted.append(ScheduledRequest(request, request.num_computed_tokens, num_new))
            budget -= num_new
        return admitted

    def _undo_admission(self, request: Request) -> None:
        """Give back the prefix-cache hits taken by a lookup for a request that stays waiting."""
        self.kv_cache_manager.free(request)
        request.num_computed_tokens = 0
        request.num_cached_tokens = 0

    def _remove(self, request: Request, status: RequestStatus) -> None:
        """Take a request out of the queues, free its blocks and record it as finished."""
        if request in self.running:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.kv_cache_manager.free(request)
        request.status = status
        if request.finish_time is None:
            request.finish_time = time.monotonic()
        del self._requests[request.request_id]
        self._finished_ids.append(request.request_id)


def _note_first_admission(request: Request) -> None:
    """Keep the cached-token count of a request's first admission (``first_num_cached_tokens``:
    the one outputs report), once its device and host-tier hits are counted."""
    if request.first_num_cached_tokens is None:
        request.first_num_cached_tokens = request.num_cached_tokens
