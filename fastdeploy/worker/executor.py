"""The worker the engine drives: one :class:`GpuWorker`, or rank 0 of a tensor-parallel group.

``make_worker(config, plan)`` returns a :class:`GpuWorker` for ``tensor_parallel_size=1``
and a :class:`TensorParallelWorker` otherwise; both offer the engine the same calls
(``load_model``, ``determine_num_blocks``, ``initialize_kv_cache``,
``graph_optimize_and_warm_up_model``, ``execute_model``, ``shutdown``) and the same reads
(``kv_caches``, ``get_stats``, ``bytes_per_block``, ...).

Under tensor parallelism rank 0 runs in the engine's process and ranks ``1..N-1`` of this node
run in processes of their own (:mod:`fastdeploy.worker.worker_process`). Rank 0 sends each call
it makes to the other ranks before making it, so they run the same steps in the same order; a
step travels as :func:`~fastdeploy.worker.input_batch.rank_step` with the graph mode and bucket
rank 0 chose. A rank that dies ends the engine with :class:`RankDiedError` naming it: a watchdog
thread waits on the rank processes, and a collective broken by the dead peer is reported as that
rank's death, within seconds, never a hang.
"""

from __future__ import annotations

import logging
import socket
import threading
import weakref
from typing import Any

import torch

from fastdeploy.config import DeploymentPlan, FDConfig
from fastdeploy.core.scheduler_output import SchedulerOutput
from fastdeploy.distributed.launcher import RankDiedError, RankProcesses
from fastdeploy.distributed.parallel_state import (
    abort_tp_group,
    broadcast_step,
    destroy_tp_group,
    init_tp_group,
)
from fastdeploy.model_executor.model_loader import check_tensor_parallel
from fastdeploy.worker.async_output import PendingOutput
from fastdeploy.worker.gpu_worker import GpuWorker
from fastdeploy.worker.input_batch import rank_step
from fastdeploy.worker.worker_process import (
    RankCall,
    ranks_per_node,
    release_communication,
    run_rank,
    setup_communication,
    share_cpu_threads,
)

logger = logging.getLogger(__name__)

__all__ = ["RankDiedError", "TensorParallelWorker", "make_worker", "run_node"]

#: How long a failed collective waits for the watchdog to find the rank that caused it.
DEATH_WAIT_S = 5.0
#: How long ranks get to exit on their own after ``shutdown`` before SIGTERM.
EXIT_WAIT_S = 5.0


def make_worker(config: FDConfig, plan: DeploymentPlan) -> GpuWorker | TensorParallelWorker:
    """The engine's worker for ``config`` (see the module docstring).

    Raises:
        ValueError: a model that cannot be split over ``tensor_parallel_size`` ranks, a
            ``tensor_parallel_size`` that does not divide by ``nnodes``, or ``node_rank != 0``
            (the engine runs on node 0; other nodes run :func:`run_node`).
    """
    if config.parallel_config.tensor_parallel_size == 1:
        return GpuWorker(config, plan.graph)
    return TensorParallelWorker(config, plan)


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TensorParallelWorker:
    """Rank 0 of a tensor-parallel group, with :class:`GpuWorker`'s interface.

    Starting it starts this node's other ranks and joins the group with them; it raises if one
    of them dies before joining. Each call is sent to the other ranks, then made on rank 0's own
    :class:`GpuWorker`; only rank 0 samples, and :meth:`execute_model` returns its tokens.

    Args:
        config: the engine config (``tensor_parallel_size > 1``).
        plan: the deployment plan every rank follows (sent to the other ranks as it is).

    Attributes:
        worker: rank 0's :class:`GpuWorker`.
        kv_caches: rank 0's KV cache (after :meth:`load_model`), as with one rank; rank 0's
            other data attributes (``runner`` included) read through as well.
        ranks: the rank processes of this node (ranks ``1..ranks_per_node-1``).

    Raises:
        ValueError: see :func:`make_worker`.
        RankDiedError: a rank process died before joining the group or during the set-up.
        TimeoutError: a rank did not join in time (another node's, typically).
    """

    def __init__(self, config: FDConfig, plan: DeploymentPlan) -> None:
        parallel = config.parallel_config
        world = parallel.tensor_parallel_size
        local_ranks = ranks_per_node(world, parallel.nnodes)
        if parallel.node_rank != 0:
            raise ValueError(
                f"node_rank={parallel.node_rank} is invalid for the engine; allowed: 0 (the "
                f"other nodes run fastdeploy.worker.executor.run_node)"
            )
        check_tensor_parallel(config.model_source.hf_config, world)  # before any process starts
        self.config = config
        self.graph_plan = plan.graph
        self.device_type = config.device_config.device
        self.dist_init_addr = parallel.dist_init_addr or f"127.0.0.1:{free_port()}"
        self.worker: GpuWorker | None = None
        self._failure: BaseException | None = None
        self._closed = False
        self._num_threads = torch.get_num_threads()
        if self.device_type == "cpu":
            share_cpu_threads(local_ranks)
        self.ranks = RankProcesses(
            run_rank, list(range(1, local_ranks)), args=(self.dist_init_addr, config)
        )
        self.ranks.start()
        self._watch = RankWatch(self.ranks, abort_group=self.device_type == "cuda")
        # Ends the ranks if the engine drops this object without shutdown().
        self._finalizer = weakref.finalize(self, _stop, self.ranks, self._watch)
        try:
            self.tp = init_tp_group(
                0, world, self.dist_init_addr, self.device_type, wait_poll=self.ranks.check
            )
            # Watched from here on (the rendezvous polled by itself): a rank that dies in the
            # set-up's collectives (NCCL warm-up, the fusion workspace) aborts the group
            # instead of leaving rank 0 waiting.
            self._watch.start()
            broadcast_step(plan, self.tp)
            self.tp = setup_communication(self.tp, config, plan)
            self.worker = GpuWorker(config, plan.graph, tp=self.tp)
        except BaseException as e:
            # A collective broken by a dead peer: let the watchdog name the rank.
            if (
                self._watch.started
                and isinstance(e, RuntimeError)
                and not isinstance(e, RankDiedError)
            ):
                self._watch.died.wait(DEATH_WAIT_S)
            death = self._watch.death
            self._finalizer()
            torch.set_num_threads(self._num_threads)
            if death is not None and isinstance(e, Exception):
                raise death from e
            raise
        logger.info(
            "tensor parallel: %d ranks (%d on this node, pids %s), rendezvous %s",
            world,
            local_ranks,
            self.rank_pids,
            self.dist_init_addr,
        )

    # ------------------------------------------------------------- the worker interface
    def load_model(self) -> None:
        self._call("load_model")

    def determine_num_blocks(self) -> int:
        """KV blocks of every rank: the smallest count any rank can hold (each rank holds
        ``num_kv_heads / N`` heads of every block)."""
        return self._call("determine_num_blocks")

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._call("initialize_kv_cache", num_blocks)

    def graph_optimize_and_warm_up_model(self) -> None:
        self._call("graph_optimize_and_warm_up_model")

    def graph_capture_pending(self) -> bool:
        """Whether the background capture has graphs left (rank 0's progress; every rank
        captures the same tasks in the same order)."""
        return self.worker.graph_capture_pending()

    def capture_next_graph(self) -> dict | None:
        """Capture the next graph on every rank; the ranks agree on its outcome
        (:meth:`GpuWorker.capture_next_graph`). None when nothing is pending (nothing is
        sent)."""
        if not self.worker.graph_capture_pending():
            return None
        return self._call("capture_next_graph")

    def execute_model(self, sched: SchedulerOutput) -> dict[str, Any]:
        """Run one step on every rank; rank 0's sampled tokens (request id -> ``SampledToken``).

        Raises:
            RankDiedError: a rank died (before or during the step), naming it.
            RuntimeError: the step failed otherwise; the group cannot continue.
        """
        if sched.is_empty:  # only rank 0 keeps per-request state (sampling), nothing to send
            self._check_alive()
            return self.worker.execute_model(sched)
        dispatch = self.worker.dispatch(sched)
        return self._call("execute_model", sched, dispatch, sent=(rank_step(sched), dispatch))

    def execute_model_async(self, sched: SchedulerOutput) -> PendingOutput:
        """:meth:`execute_model`, already waited for: the steps of a tensor-parallel group are
        synchronous (the overlap schedule is off under tensor parallelism)."""
        return PendingOutput.ready(self.execute_model(sched))

    def shutdown(self) -> None:
        """End every rank (a shutdown message, then SIGTERM/SIGKILL for any left) and release
        rank 0's model, KV cache and graphs. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._watch.stopping.set()
        told = False
        if self.worker is not None and self._failure is None and self._watch.death is None:
            try:
                broadcast_step(RankCall("shutdown"), self.tp)
                told = True
            except Exception as e:  # noqa: BLE001 - the ranks are stopped below either way
                logger.warning("could not send shutdown to the ranks: %s", e)
        if self.worker is not None:
            self.worker.shutdown()
        if told:  # the ranks free the fused all-reduce's workspace at the same point
            try:
                release_communication(self.tp)
            except Exception as e:  # noqa: BLE001 - the ranks are stopped below either way
                logger.warning("freeing the fused all-reduce workspace failed: %s", e)
        # Ranks that were told exit on their own; others may be stuck in a collective.
        self.ranks.stop(exit_wait_s=EXIT_WAIT_S if told else 0.0)
        self._finalizer()
        torch.set_num_threads(self._num_threads)

    # ------------------------------------------------------------- what tests and stats read
    @property
    def rank_pids(self) -> dict[int, int | None]:
        """rank -> process id of this node's other ranks."""
        return self.ranks.pids

    def blocks_needed_at_most(self) -> int:
        """See :meth:`GpuWorker.blocks_needed_at_most` (the same on every rank)."""
        return self.worker.blocks_needed_at_most()

    def get_stats(self) -> dict:
        """Rank 0's step counters (:meth:`GpuWorker.get_stats`); every rank runs the same
        steps in the same modes."""
        return self.worker.get_stats()

    def __getattr__(self, name: str) -> Any:
        """Rank 0's data attributes (``num_kv_heads`` and ``head_dim`` of one rank,
        ``num_blocks``, ``bytes_per_block``, ``dtype``, ...). Methods are not passed through:
        one that runs the model would run on rank 0 alone and leave the ranks out of step."""
        worker = self.__dict__.get("worker")
        if worker is None or name.startswith("__"):
            raise AttributeError(name)
        value = getattr(worker, name)
        if callable(value):
            raise AttributeError(
                f"{type(self).__name__} does not forward {name}() to the other ranks"
            )
        return value

    # ------------------------------------------------------------- internals
    def _call(self, method: str, *args: Any, sent: tuple | None = None) -> Any:
        """Send ``method`` (with ``sent``, or ``args``) to the other ranks, then run it here."""
        self._check_alive()
        try:
            broadcast_step(RankCall(method, args if sent is None else sent), self.tp)
            return getattr(self.worker, method)(*args)
        except Exception as e:
            self._failure = self._explain(e)
            raise self._failure from e
        except BaseException as e:  # KeyboardInterrupt: the ranks may be mid-call, out of step
            self._failure = RuntimeError(f"a tensor-parallel worker call was interrupted ({e!r})")
            raise

    def _check_alive(self) -> None:
        if self._closed:
            raise RuntimeError("the tensor-parallel worker was shut down")
        if self._failure is None and self._watch.death is not None:
            self._failure = self._watch.death
        if self._failure is not None:
            raise self._failure

    def _explain(self, error: Exception) -> BaseException:
        """The error to report for a failed call: the death of a rank when one died (a broken
        collective is how a dead peer shows; the watchdog names it within
        :data:`DEATH_WAIT_S`), else a RuntimeError saying the group cannot continue."""
        if isinstance(error, RuntimeError):
            self._watch.died.wait(DEATH_WAIT_S)
        if self._watch.death is not None:
            return self._watch.death
        return RuntimeError(
            f"tensor-parallel rank 0 failed in a worker call ({error!r}); the ranks are out of "
            f"step and the engine cannot continue"
        )


class RankWatch:
    """A daemon thread waiting on the rank processes; records the first death (``death``,
    ``died``). It holds no reference to the worker, so an engine that drops its worker without
    ``shutdown()`` still lets the finalizer end the ranks.

    Args:
        ranks: the processes to watch.
        abort_group: abort the process group on a death. NCCL never notices a dead peer by
            itself, so a collective blocked on one would wait for its timeout; gloo sees the
            closed socket at once.
    """

    def __init__(self, ranks: RankProcesses, abort_group: bool) -> None:
        self.ranks = ranks
        self.abort_group = abort_group
        self.death: RankDiedError | None = None
        self.died = threading.Event()
        self.stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fastdeploy-rank-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def started(self) -> bool:
        return self._thread.ident is not None

    def _run(self) -> None:
        while not self.stopping.is_set():
            try:
                self.ranks.check(timeout_s=0.2)
            except RankDiedError as e:
                if self.stopping.is_set():  # shutting down: ranks exit on purpose
                    return
                logger.error("%s", e)
                self.death = e
                self.died.set()
                if self.abort_group:
                    abort_tp_group()
                return


def _stop(ranks: RankProcesses, watch: RankWatch) -> None:
    """End the ranks and leave the group (the finalizer of :class:`TensorParallelWorker`)."""
    watch.stopping.set()
    ranks.stop(grace_s=2.0)
    try:
        destroy_tp_group()
    except Exception as e:  # noqa: BLE001 - a broken group is being left anyway
        logger.warning("leaving the tensor-parallel group failed: %s", e)


def run_node(config: FDConfig) -> None:
    """Run the ranks of one node other than 0 (``--nnodes`` > 1, ``--node-rank`` k): ranks
    ``k * ranks_per_node ..`` start here, join rank 0's group at ``dist_init_addr``, and follow
    its calls until it shuts them down.

    Raises:
        ValueError: ``node_rank`` 0, no ``dist_init_addr``, or a size that does not divide.
        RankDiedError: a rank of this node failed (its traceback is in this node's log).
    """
    parallel = config.parallel_config
    local_ranks = ranks_per_node(parallel.tensor_parallel_size, parallel.nnodes)
    if parallel.node_rank == 0 or parallel.dist_init_addr is None:
        raise ValueError(
            f"node_rank={parallel.node_rank}, dist_init_addr={parallel.dist_init_addr!r} is "
            f"invalid for run_node; allowed: node_rank >= 1 and rank 0's host:port"
        )
    first = parallel.node_rank * local_ranks
    ranks = RankProcesses(
        run_rank, list(range(first, first + local_ranks)), args=(parallel.dist_init_addr, config)
    )
    with ranks:
        for rank, process in ranks.processes.items():
            process.join()
            if process.exitcode != 0:
                raise RankDiedError(rank, process.exitcode)
