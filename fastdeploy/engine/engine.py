"""The engine core: admission, the step loop, stop conditions.

``LLMEngine.step()`` asks the scheduler for a batch, runs it on the worker, appends the sampled
tokens, and lets the :class:`~fastdeploy.core.stop_checker.StopChecker` decide, token by token,
which requests have ended (eos, stop token ids, stop strings, ``max_tokens``, ``max_model_len``,
all under ``min_tokens``) and what text they add. Detokenisation runs here, on the engine's
thread (about 0.8 us per token), because the stop decision needs the text: a request that hits a
stop string frees its KV blocks in the same step, and the front ends only pass text on.

Where the deployment plan turns the overlap schedule on (rule 10; ``--disable-overlap-schedule``
turns it off), ``step()`` launches step N before it reads step N-1's tokens, so the host schedules
while the device computes; :mod:`fastdeploy.engine.step_pipeline` says how stop conditions,
aborts and preemption stay exact.

The engine owns its parts rather than mixing them in: the step pipeline
(:class:`~fastdeploy.engine.step_pipeline.StepPipeline`) launches and finishes steps, and on a PD
node :class:`~fastdeploy.engine.pd_steps.PDSteps` does the prefill/decode bookkeeping around the
node's role (a :class:`~fastdeploy.splitwise.pd_role.PDRole`).

Admission is bounded by the KV pool: at start-up ``max_model_len`` is lowered, with a warning, to
what the pool holds for one request (``fit_max_model_len`` in
:mod:`fastdeploy.cache_manager.kv_cache_manager`), so a prompt that could never fit is refused at
once with the numbers, and a running request that outgrows the free blocks is preempted and
resumed, never aborted.

With ``--swap-space`` the engine also drives the host KV tier
(:class:`~fastdeploy.cache_manager.host_tier.HostTier`): at the start of each step it issues the
write-through stores of the blocks cached in the previous step and polls the copies in flight;
after scheduling it issues the swap-ins of this step's host hits, whose per-layer events go into
the forward in ``layerwise`` mode.

With ``--kv-events-config '{"enable_kv_cache_events": true, ...}'`` the KV cache manager and the
host tier record vLLM's KV-cache events, and after each step the engine takes them and hands them,
as one batch, to the publisher (:mod:`fastdeploy.distributed.kv_event_publisher`), which sends
them from its own thread; ``docs/kv-events.md`` has the wire format.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from typing import TYPE_CHECKING, Any

from fastdeploy import envs
from fastdeploy.config import FDConfig
from fastdeploy.core.gc_heap import freeze_startup_heap, unfreeze_heap
from fastdeploy.core.outputs import EngineOutput
from fastdeploy.core.request import Request, RequestStatus
from fastdeploy.core.sampling_params import SamplingParams
from fastdeploy.engine.admission import Admission
from fastdeploy.engine.args_utils import EngineArgs
from fastdeploy.engine.pd_steps import PDSteps, engine_kv_layout, error_output
from fastdeploy.engine.step_pipeline import StepPipeline
from fastdeploy.engine.structured_output import StructuredOutputs

if TYPE_CHECKING:
    from fastdeploy.config.plan import DeploymentPlan
    from fastdeploy.splitwise.pd_role import PDRole

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
        plan: the deployment plan of ``config``
            (:func:`fastdeploy.config.resolve.resolve_deployment`, once per start: the one
            ``--print-config`` shows). Required: the engine never resolves a plan itself.
        startup_seconds: start-up phases timed before the engine (name -> seconds); None: the
            process's age as ``imports``.
        freeze_heap: freeze the start-up heap at the end of construction (False: the caller
            calls :meth:`freeze_heap` later, as the engine process does once it reported ready).

    Attributes:
        plan: the deployment plan this engine runs (logged at start, reported as
            ``describe()["deployment_plan"]``); ``graph_plan`` is its ``plan.graph``.
        max_model_len: the admission bound: the configured ``max_model_len``, or less when the
            KV pool holds fewer tokens for one request (``max_model_len_note`` then says so).
        pipeline: launches and finishes steps (:class:`StepPipeline`).
        pd_steps: the PD bookkeeping on a prefill or decode node (:class:`PDSteps`); None on a
            ``mixed`` node.
        last_step_idle: whether the last :meth:`step` launched and finished nothing.

    Raises:
        ValueError: a setting not supported yet, a bad plan, a device this machine lacks, a KV
            pool too small for any request, or ``FD_GC_FREEZE`` not a boolean (checked before
            the model loads), or ``FD_GRAPH_CAPTURE_BUSY_SHARE`` outside (0, 1].
    """

    #: Set by start-up; None until then (and on a ``mixed`` node), so shutdown works on a
    #: partly started engine.
    pd_steps: PDSteps | None = None
    kv_layout: dict | None = None
    kv_event_publisher: Any = None
    _kv_events_on = False

    def __init__(
        self,
        config: FDConfig,
        plan: DeploymentPlan,
        startup_seconds: dict[str, float | None] | None = None,
        freeze_heap: bool = True,
    ) -> None:
        from fastdeploy.config.plan import DeploymentPlan
        from fastdeploy.core.startup import StartupPhases, process_age_seconds
        from fastdeploy.worker.executor import make_worker

        if startup_seconds is None:  # the process's age: interpreter, imports, arguments
            startup_seconds = {"imports": process_age_seconds()}
        self.startup = StartupPhases(startup_seconds)

        if not isinstance(plan, DeploymentPlan):
            raise TypeError(
                f"plan={type(plan).__name__} is invalid; allowed: the DeploymentPlan of config "
                "(fastdeploy.config.resolve.resolve_deployment or plan_deployment)"
            )
        config.check_supported()
        check_device_available(config.device_config.device)
        gc_freeze = envs.FD_GC_FREEZE()  # a bad value fails here, before the model loads
        self._capture_busy_share = envs.FD_GRAPH_CAPTURE_BUSY_SHARE()  # likewise
        # An earlier engine's frozen heap (one dropped without shutdown) is collected before
        # this one sizes its KV cache from the free memory.
        unfreeze_heap(collect=True)
        self.config = config
        self.plan = plan
        self.graph_plan = plan.graph
        self.source = config.model_source
        logger.info("deployment plan: %s", json.dumps(plan.to_dict()))
        self.tokenizer = None
        if not config.model_config.skip_tokenizer_init:
            with self.startup.phase("tokenizer"):
                self.tokenizer = self.source.load_tokenizer()
        self.vocab_size = self.source.hf_config.vocab_size
        self.eos_token_ids = frozenset(self._eos_ids())
        with self.startup.phase("workers"):  # tensor-parallel ranks start here
            self.worker = make_worker(self.config, self.plan)
        try:
            self._start(config)
            self._gc_freeze = gc_freeze
            if freeze_heap:
                self.freeze_heap()
            logger.info("start-up phases: %s", self.startup.describe())
        except BaseException:
            if self.kv_event_publisher is not None:
                self.kv_event_publisher.shutdown()  # closes its sockets and thread
            self.worker.shutdown()  # a tensor-parallel worker also ends its rank processes
            raise

    def freeze_heap(self) -> None:
        """Freeze the start-up heap (:func:`~fastdeploy.core.gc_heap.freeze_startup_heap`: full
        collections skip it), timed as start-up phase ``heap_freeze``. ``__init__`` calls it
        unless ``freeze_heap=False``: the engine process calls it after reporting ready, so the
        full collection before the freeze (0.3-0.4 s on the H200 host) runs while the API server
        starts instead of before."""
        start = time.perf_counter()
        with self.startup.phase("heap_freeze"):
            freeze_startup_heap("engine", self._gc_freeze)
        logger.info("start-up heap frozen in %.2f s", time.perf_counter() - start)

    def _start(self, config: FDConfig) -> None:
        """Load the model, size and allocate the KV cache, capture graphs, build the scheduler
        and the PD role (the rest of ``__init__``, undone by the caller if it raises)."""
        from fastdeploy.cache_manager.kv_cache_manager import fit_max_model_len

        cache = self.config.cache_config
        num_host_blocks = 0
        if cache.swap_space > 0:  # an oversized request fails before the model loads
            from fastdeploy.worker.host_kv_pool import host_blocks_for

            num_host_blocks = host_blocks_for(cache.swap_space, self.worker.bytes_per_block)
        phase = self.startup.phase
        with phase("weights"):
            self.worker.load_model()
        with phase("memory_profile"):
            num_blocks = self.worker.determine_num_blocks()
        self.max_model_len, self.max_model_len_note = fit_max_model_len(
            config.model_config.max_model_len, num_blocks, cache.block_size
        )
        self._log_kv_cache(num_blocks)
        with phase("kv_allocation"):
            self.worker.initialize_kv_cache(num_blocks)
        # Ends with the step counters at zero: the metrics count served steps only.
        start = time.perf_counter()
        self.worker.graph_optimize_and_warm_up_model()
        elapsed = time.perf_counter() - start
        # Kernel warm-up (flashinfer's JIT build or cache load) and capture before serving, as
        # the worker timed them (rank 0's); the rest of the call as "warmup_other".
        parts = getattr(self.worker, "startup_seconds", None) or {}
        for name, seconds in parts.items():
            self.startup.add(name, seconds)
        self.startup.add("warmup_other", max(elapsed - sum(parts.values()), 0.0))
        with phase("engine_setup"):  # scheduler, step pipeline, PD role, KV events
            self._build_scheduling(config, num_blocks, num_host_blocks)

    def _build_scheduling(self, config: FDConfig, num_blocks: int, num_host_blocks: int) -> None:
        """The rest of start-up once the model is served: the KV cache manager, the host tier,
        the scheduler, the step pipeline, the capture pacer, the PD role and the KV-event
        publisher (part of ``__init__``)."""
        from fastdeploy.cache_manager.kv_cache_manager import KVCacheManager
        from fastdeploy.core.stop_checker import StopChecker
        from fastdeploy.scheduler.scheduler import Scheduler

        cache = self.config.cache_config
        events = config.kv_events_config
        self.kv_cache_manager = KVCacheManager(
            num_blocks,
            cache.block_size,
            cache.enable_prefix_caching,
            cache.prefix_caching_hash_algo,
            events.enable_kv_cache_events and cache.enable_prefix_caching,
        )
        self.host_tier = None
        if num_host_blocks:
            from fastdeploy.cache_manager.host_tier import HostTier

            self.worker.initialize_host_kv_pool(num_host_blocks)
            self.host_tier = HostTier(
                self.kv_cache_manager,
                num_host_blocks,
                self.worker.bytes_per_block,
                self.worker,
                cache.swap_in_mode,
                cache.host_store_policy,
            )
        self.scheduler = Scheduler(
            self.config.scheduler_config, self.kv_cache_manager, self.max_model_len, self.host_tier
        )
        self.stop_checker = StopChecker(self.max_model_len, self.tokenizer)
        self.grammars = StructuredOutputs(self.tokenizer, self.vocab_size)
        #: Requests whose grammar is still compiling: they enter the scheduler once it has, so
        #: the step loop never waits for a compile (:meth:`_admit_compiled`).
        self.compiling: dict[str, tuple[Request, float]] = {}
        self.pipeline = StepPipeline(
            self.worker, self.scheduler, self.host_tier, self.overlap_schedule, self.grammars
        )
        self.last_step_idle = False
        from fastdeploy.model_executor.graph_optimization.capture_order import GapPacer

        self.capture_pacer = GapPacer(self._capture_busy_share)
        self.kv_layout = engine_kv_layout(
            config,
            self.source.path,
            self.worker.kv_caches,
            self.worker.num_kv_heads,
            self.worker.head_dim,
        )
        if config.parallel_config.splitwise_role != "mixed":
            from fastdeploy.splitwise.roles import make_role

            role = make_role(config, self.worker.kv_caches, self.kv_layout, cache.block_size)
            self.pd_steps = PDSteps(
                role,
                self.scheduler,
                self.kv_cache_manager,
                config.splitwise_config.pd_decode_wait_timeout,
            )
        self._kv_events_on = self.kv_cache_manager.records_events
        if self._kv_events_on:  # last: nothing after it can fail and leave its sockets open
            from fastdeploy.distributed.kv_event_publisher import make_event_publisher

            self.kv_event_publisher = make_event_publisher(events)

    @property
    def pd(self) -> PDRole | None:
        """This node's PD role; None on a ``mixed`` node."""
        return self.pd_steps.role if self.pd_steps is not None else None

    @property
    def overlap_schedule(self) -> bool:
        """The plan's rule 10: step N+1 is scheduled while step N runs."""
        return self.plan.overlap_schedule

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
        """Resolve ``engine_args`` once
        (:func:`~fastdeploy.config.resolve.resolve_deployment`: the config, then its deployment
        plan) and start an engine on the result.

        Raises:
            ValueError: a bad or not yet supported argument; FileNotFoundError: missing model.
        """
        from fastdeploy.config.resolve import resolve_deployment
        from fastdeploy.core.startup import process_age_seconds

        imports = process_age_seconds()
        start = time.perf_counter()
        config, plan = resolve_deployment(engine_args)
        startup = {"imports": imports, "config_and_plan": time.perf_counter() - start}
        return cls(config, plan, startup_seconds=startup)

    def describe(self) -> dict[str, Any]:
        """``{"config": ..., "deployment_plan": ...}`` as JSON-able dicts: what this engine runs
        (``/v1/server_info``); ``--print-config`` prints the same two for the same flags."""
        return {"config": self.config.to_dict(), "deployment_plan": self.plan.to_dict()}

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
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None = None,
        kv_transfer_params: dict | None = None,
    ) -> Any:
        """Admission check of a request, the one every front end calls before queuing.

        Returns what ``kv_transfer_params`` asks for: None (a plain request), True (a prefill
        leg) or the decode leg's ``RemotePrefill``.

        Pure: it reads only what start-up fixed, so it is safe to call from another thread than
        the one that steps the engine.

        Raises:
            ValueError, PromptTooLongError: see :meth:`Admission.check`.
        """
        return self.admission().check(prompt_token_ids, sampling_params, kv_transfer_params)

    def admission(self) -> Admission:
        """What requests are checked against, from this engine's start-up values (picklable:
        the server checks requests with it when the engine runs in a process of its own)."""
        return Admission(
            self.max_model_len,
            self.vocab_size,
            self.tokenizer is not None,
            self.max_model_len_note,
            self.config.parallel_config.splitwise_role,
            self.kv_layout,
            self.config.cache_config.block_size,
            self.config.parallel_config.tensor_parallel_size,
            self.pd.trust if self.pd is not None else None,
        )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        kv_transfer_params: dict | None = None,
    ) -> Request:
        """Queue a request.

        ``kv_transfer_params`` (vLLM's field) makes it a leg of a PD request: on a prefill node
        ``{"do_remote_decode": true}`` (it samples one token, then its blocks wait for the decode
        node and its last output carries where they are); on a decode node the prefill node's
        answer (its KV is pulled, its first token is the prefill node's).

        A refused decode leg (on a decode node) releases the prefill node's blocks.

        Raises:
            ValueError: what :meth:`check_request` raises, or a duplicate id.
        """
        try:
            leg = self.check_request(prompt_token_ids, sampling_params, kv_transfer_params)
        except ValueError:
            if self.config.parallel_config.splitwise_role == "decode":
                from fastdeploy.splitwise.legs import release_refused_leg

                # no decode node will pull them now
                release_refused_leg(kv_transfer_params, self.admission().pd_trust)
            raise
        if self.scheduler.get_request(request_id) is not None or request_id in self.compiling:
            raise ValueError(f"request id {request_id!r} is already in use")
        if leg is True:
            # The prefill node samples the first token only, unconstrained by min_tokens (a
            # router may set min_tokens=1 on this leg): the decode node applies the client's.
            sampling_params = dataclasses.replace(sampling_params, max_tokens=1, min_tokens=0)
        request = Request(
            request_id, list(prompt_token_ids), sampling_params, eos_token_ids=self.eos_token_ids
        )
        if leg is True:
            request.remote_decode = True
        elif leg is not None:
            request.remote_prefill = leg
            self.pd_steps.expect_remote_kv(request_id)
        self.grammars.add(request)  # raises on a spec that does not parse
        self.stop_checker.start(request)
        if self.grammars.compile_state(request_id) is True:
            self.scheduler.add_request(request)
        else:
            self.compiling[request_id] = (request, time.monotonic())
        return request

    def _admit_compiled(self) -> list[EngineOutput]:
        """Move requests whose grammar has compiled into the scheduler; end those whose compile
        failed, or is still running after ``FD_STRUCTURED_OUTPUT_COMPILE_TIMEOUT_S``, with an
        error output (a ``ValueError``: a 400 naming ``structured_outputs``)."""
        failed = []
        timeout = envs.FD_STRUCTURED_OUTPUT_COMPILE_TIMEOUT_S()
        now = time.monotonic()
        for request_id, (request, since) in list(self.compiling.items()):
            state = self.grammars.compile_state(request_id)
            if state is False and now - since <= timeout:
                continue
            del self.compiling[request_id]
            if state is True:
                self.scheduler.add_request(request)
                continue
            self.grammars.free(request_id)
            if state is False:
                error = ValueError(
                    f"structured_outputs did not compile within {timeout:g} s "
                    "(FD_STRUCTURED_OUTPUT_COMPILE_TIMEOUT_S); allowed: a grammar that compiles "
                    "in time, e.g. a JSON schema with fewer optional properties per object"
                )
            else:
                error = ValueError(f"structured_outputs is invalid: {state}; allowed: a grammar "
                                   "xgrammar compiles")  # fmt: skip
            logger.warning("request %s: %s", request_id, error)
            failed.append(error_output(request, error))
        return failed

    def abort_request(self, request_id: str) -> bool:
        """Abort a waiting or running request and free its KV blocks; False if unknown.

        A decode-leg request whose KV is being pulled keeps its blocks until the pull has
        stopped writing (then they are freed); the prefill node is told to free its copy.
        """
        self.grammars.free(request_id)
        if self.compiling.pop(request_id, None) is not None:
            return True  # never reached the scheduler
        if self.pd_steps is not None:
            return self.pd_steps.abort(request_id)
        return self.scheduler.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        """True while a request is waiting or running, or a launched step's tokens are unread
        (overlap schedule: one more ``step()`` emits them)."""
        return (
            self.scheduler.has_unfinished_requests()
            or self.pipeline.in_flight is not None
            or bool(self.compiling)
        )

    def has_background_work(self) -> bool:
        """True while bookkeeping needs steps even without requests: host-tier copies queued or
        in flight; in PD, blocks held for decode nodes (lease expiry), pulls in flight, or
        aborted pulls whose blocks wait."""
        if self.host_tier is not None and self.host_tier.has_work:
            return True
        return self.pd_steps is not None and self.pd_steps.has_background_work()

    # ------------------------------------------------------------ background capture
    def graph_capture_pending(self) -> bool:
        """Whether CUDA graphs are still to be captured in the background (issue #47): the
        engine serves meanwhile, each step eagerly until its bucket is captured."""
        return self.worker.graph_capture_pending()

    def capture_next_graph(self) -> dict | None:
        """Capture one graph now, between steps (``GpuWorker.capture_next_graph``); the
        :class:`~fastdeploy.engine.engine_loop.EngineLoop` calls it while idle, :meth:`step`
        before a step when the pacer allows. Returns the task's outcome, or None when nothing
        is pending."""
        done = self.worker.capture_next_graph()
        if done is not None:
            self.capture_pacer.record(done["seconds"])
        return done

    def finish_graph_capture(self) -> None:
        """Capture every graph a background capture has left, now (offline use: ``LLM``, and
        benchmarks that time replayed steps)."""
        while self.graph_capture_pending():
            self.capture_next_graph()

    def set_wakeup(self, wakeup) -> None:
        """Call ``wakeup()`` from another thread when background work ends (a pull finished, a
        grammar compiled), so a loop idling between steps steps again at once."""
        if self.pd is not None:
            self.pd.set_wakeup(wakeup)
        self.grammars.on_compiled = wakeup  # a request waiting for its grammar can run

    def check_integrity(self) -> None:
        """The scheduler's integrity check, counting blocks held for decode nodes.

        Raises:
            AssertionError: naming the first broken invariant.
        """
        held = self.pd_steps.held_block_tables() if self.pd_steps is not None else []
        if self.host_tier is not None:
            held += self.host_tier.held_block_tables()
            self.host_tier.check_integrity()
        self.scheduler.check_integrity(held)

    # ------------------------------------------------------------ the step
    def step(self) -> list[EngineOutput]:
        """Schedule and launch one step, and post-process the step that is due; returns its new
        tokens and text. Without the overlap schedule that is this step; with it, the previous
        one (this one runs on while the host returns; see :mod:`fastdeploy.engine.step_pipeline`).

        While graphs are captured in the background, one graph is captured first when the
        capture pacer (:class:`~fastdeploy.model_executor.graph_optimization.capture_order.
        GapPacer`) allows: capture takes at most ``FD_GRAPH_CAPTURE_BUSY_SHARE`` (default a third)
        of the wall time while requests run.

        A request the :class:`~fastdeploy.core.stop_checker.StopChecker` ends is finished in
        the scheduler (its KV blocks freed) before this returns. With KV-cache events on, the
        step's events are handed to the publisher before this returns.
        """
        if self.graph_capture_pending() and self.capture_pacer.due(busy=True):
            self.capture_next_graph()  # in the gap before this step (issue #47)
        outputs = self._step()
        if self._kv_events_on:
            self.publish_kv_events()
        return outputs

    def publish_kv_events(self) -> int:
        """Take the KV-cache events recorded since the last call (device tier, then host tier)
        and hand them to the publisher as one ``KVEventBatch``; returns how many (0: no batch
        is sent). :meth:`step` calls it; it is also safe to call between steps."""
        events = self.kv_cache_manager.take_events()
        if self.host_tier is not None:
            events += self.host_tier.take_events()
        if events and self.kv_event_publisher is not None:
            from fastdeploy.distributed.kv_events import KVEventBatch

            self.kv_event_publisher.publish(KVEventBatch(time.time(), events))
        return len(events)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached device block (vLLM's ``reset_prefix_cache``), publishing
        ``AllBlocksCleared`` at once when events are on. Returns False, changing nothing, while
        a request or a copy holds a cached block, or when a host tier is configured (its
        blocks would stay cached while subscribers clear them)."""
        if self.host_tier is not None or not self.kv_cache_manager.reset_prefix_cache():
            return False
        if self._kv_events_on:
            self.publish_kv_events()
        return True

    def _step(self) -> list[EngineOutput]:
        """The body of :meth:`step`."""
        if self.compiling:
            failed = self._admit_compiled()
            if failed:
                self.last_step_idle = False
                return failed
        pd_steps = self.pd_steps
        outputs = (
            pd_steps.step(time.monotonic(), self._token_output) if pd_steps is not None else []
        )
        if outputs:
            # First tokens whose KV just landed (or failures) go out now, before a forward
            # (TTFT), and a request never gets two outputs in one step.
            self.last_step_idle = False
            return outputs
        host = self.host_tier
        if host is not None:  # stores before scheduling: nothing is evicted in between
            for request in host.begin_step():
                self.scheduler.swap_in_landed(request)
        sched = self.scheduler.schedule()
        if pd_steps is not None:
            pd_steps.start_pulls()
        layer_events = host.issue_swap_ins() if host is not None else None
        outputs = self.pipeline.run(sched, layer_events, self._token_output)
        self.last_step_idle = self.pipeline.last_step_idle
        return outputs

    def _token_output(
        self, request: Request, token_id: int, logprobs: list[dict] | None, now: float
    ) -> EngineOutput:
        """Stop-check a request's new (already appended) token and build its output; a request
        that ends is finished in the scheduler (a prefill leg's blocks are held first)."""
        status = self.stop_checker.check(request, token_id)
        if self.grammars.accept(request, token_id) and status is None:
            status = RequestStatus.FINISHED_STOPPED  # the grammar ended
        finished = status is not None
        if finished:
            self.grammars.free(request.request_id)
        kv_params = None
        if finished:
            request.finish_time = now
            if request.remote_decode:
                kv_params = self.pd_steps.hold_for_decode(request, token_id, logprobs)
            self.scheduler.finish_request(request, status)
        detok = request.detokenizer
        return EngineOutput(  # positional: once per request per step
            request.request_id,
            [token_id],
            logprobs,
            finished,
            status.value if finished else None,
            request.num_prompt_tokens,
            request.reported_cached_tokens,
            detok.take_delta(finished) if detok is not None else "",  # new_text
            request.stop_reason if finished else None,
            kv_params,
            None,  # error
            self._first_prompt_logprobs(request),
        )

    @staticmethod
    def _first_prompt_logprobs(request: Request) -> list[dict | None] | None:
        """A request's whole prompt logprobs on its first output (one entry per prompt token by
        then: its last prefill step is the one that samples), None on every other output and for
        requests that did not ask."""
        entries = request.prompt_logprobs
        if entries is None or len(request.output_token_ids) != 1:
            return None
        if len(entries) != request.num_prompt_tokens:
            raise RuntimeError(
                f"request {request.request_id!r} has {len(entries)} prompt logprobs for "
                f"{request.num_prompt_tokens} prompt tokens at its first token"
            )
        return entries

    def get_stats(self) -> dict:
        """Counters for metrics: running/waiting requests, KV usage, steps by graph mode,
        ``graph_capture`` (with graphs: captured, failed and total graphs, ``GpuWorker.get_stats``),
        ``startup_seconds`` (start-up phase -> seconds, in the order they ran),
        ``num_preemptions``, ``prefix_cache_queries`` and ``prefix_cache_hits`` (tokens looked up
        in and found in the prefix cache at admission; all cumulative), ``block_size`` (tokens)
        and ``num_gpu_blocks`` (the pool, null block included); with a host KV tier also
        ``host_cache_hit_tokens``, ``swap_in_bytes``, ``swap_in_seconds``, ``host_store_bytes``
        (cumulative), ``host_pending_stores`` (blocks), ``host_cache_usage`` (0..1) and
        ``num_host_blocks``."""
        stats = {
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting + len(self.compiling),
            "num_waiting_for_remote_kv": self.scheduler.num_waiting_for_remote_kv,
            "num_waiting_for_swap_in": self.scheduler.num_waiting_for_swap_in,
            "num_preemptions": self.scheduler.num_preemptions,
            "kv_cache_usage": self.kv_cache_manager.usage,
            "num_free_blocks": self.kv_cache_manager.num_free_blocks,
            "num_total_blocks": self.kv_cache_manager.num_usable_blocks,
            "num_gpu_blocks": self.kv_cache_manager.num_blocks,
            "block_size": self.kv_cache_manager.block_size,
            "prefix_cache_queries": self.kv_cache_manager.prefix_cache_queries,
            "prefix_cache_hits": self.kv_cache_manager.prefix_cache_hits,
            **self.worker.get_stats(),  # steps_by_mode, num_padded_tokens, graph_capture
        }
        stats["startup_seconds"] = dict(self.startup.seconds)
        if self.pd is not None:
            stats["pd"] = self.pd.stats()
        if self.host_tier is not None:
            stats.update(self.host_tier.get_stats())
        return stats

    def shutdown(self) -> None:
        """Release the model, KV cache and graphs (an engine can be created again afterwards),
        after the KV event publisher sent what it holds and closed its sockets."""
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.shutdown()
            self.kv_event_publisher = None
        if self.pd_steps is not None:
            self.pd_steps.close()
            self.pd_steps = None
        if getattr(self, "grammars", None) is not None:
            self.grammars.shutdown()
        worker = getattr(self, "worker", None)
        if worker is not None:
            worker.shutdown()
        self.worker = None
        import gc

        import torch

        unfreeze_heap()  # the model's reference cycles were frozen with the start-up heap
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
