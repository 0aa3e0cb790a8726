"""Our engine as a Dynamo 1.6 backend: :class:`FastDeployEngine` implements Dynamo's Python
backend contract (``dynamo.common.backend.LLMEngine``: ``from_args``, ``start``, ``generate``,
``abort``, ``cleanup``, ``kv_event_sources``), and :func:`run_worker` hands it to Dynamo's
``Worker`` (``dynamo.common.backend.run``).

What Dynamo's ``Worker`` does (Dynamo 1.6 ``common/backend/README.md``): it creates the
distributed runtime (etcd discovery, TCP request plane, NATS event plane by default), registers
the model (token in / token out) with what :meth:`FastDeployEngine.start` returns, serves the
endpoint, watches each request's context (client gone, stop, kill: it calls
:meth:`FastDeployEngine.abort` and stops reading the stream), and on SIGTERM/SIGINT unregisters
from discovery, waits its grace period (``DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS``, 5 s) and
calls :meth:`FastDeployEngine.cleanup`, which drains the requests in flight itself (Dynamo 1.6
waits for none of an aggregated worker's: they failed with HTTP 500 before we drained). It
subscribes to the ZMQ socket :meth:`FastDeployEngine.kv_event_sources` names (our vLLM-format
KV-cache events: :mod:`fastdeploy.distributed.kv_event_publisher`) and relays them to the KV
router.

The engine is built exactly as ``fastdeploy serve`` builds it: the same flags, checks and
deployment plan (:mod:`fastdeploy.entrypoints.launch`), the engine loop in a process of its own
(``place_engine``; ``--disable-frontend-multiprocessing`` puts it on a thread here instead) and
our :class:`~fastdeploy.entrypoints.engine_client.async_engine.AsyncLLMEngine` in this process.
A process of its own because this process also runs Dynamo's Python callbacks: with the engine
on a thread both would share one GIL (the reason ``fastdeploy serve`` does the same).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import tempfile
import time
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from dynamo.common.backend import EngineConfig, LLMEngine, LlmRegistration, WorkerConfig
from dynamo.common.backend.publisher import ComponentSnapshot, ZmqSource
from dynamo.llm import ModelInput
from dynamo.llm.exceptions import HttpError, InvalidArgument

from fastdeploy.engine.args_utils import EngineArgs
from fastdeploy.entrypoints.engine_client.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    QueueFullError,
)
from fastdeploy.entrypoints.launch import place_engine
from fastdeploy.entrypoints.server_args import check_server_args, served_name
from fastdeploy.integrations.dynamo.args import make_worker_parser, parse_endpoint
from fastdeploy.integrations.dynamo.model_card import model_card_dir
from fastdeploy.integrations.dynamo.request_map import error_chunk, to_chunk, to_sampling_params

logger = logging.getLogger("fastdeploy.integrations.dynamo")

#: Seconds between the checks of a drain (SIGTERM) for requests still in flight.
DRAIN_POLL_S = 0.05
#: Seconds between the load snapshots sent to Dynamo's router (KV blocks in use).
LOAD_EVERY_S = 0.25


def kv_events_for_dynamo(args: argparse.Namespace) -> tempfile.TemporaryDirectory | None:
    """Turn our KV-cache events on for Dynamo's KV router unless the user chose: with prefix
    caching on, no ``--kv-events-config`` and no ``--no-dynamo-kv-events``, publish them (vLLM's
    ZMQ publisher fields) on an IPC socket in a new temporary directory, which is returned (the
    caller removes it); local to this host and free of port races, as Dynamo's own TokenSpeed
    backend does (Dynamo 1.6 ``tokenspeed/llm_engine.py``). None when nothing was set."""
    if not (args.dynamo_kv_events and args.kv_events_config is None and args.enable_prefix_caching):
        return None
    directory = tempfile.TemporaryDirectory(prefix="fastdeploy-kv-events-")
    args.kv_events_config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"ipc://{directory.name}/kv-events",
    }
    return directory


class FastDeployEngine(LLMEngine):
    """Dynamo's ``LLMEngine`` over our async engine.

    Args:
        args: the parsed command line (:func:`~.args.make_worker_parser`).

    Raises:
        ValueError, FileNotFoundError, OSError: a bad flag, model or deployment plan (the same
            checks as ``fastdeploy serve``), raised before the model loads.
    """

    def __init__(self, args: argparse.Namespace) -> None:
        check_server_args(args)
        self._events_dir = kv_events_for_dynamo(args)
        self.args = args
        engine_args = EngineArgs.from_cli_args(args)
        from fastdeploy.config.resolve import resolve_deployment
        from fastdeploy.engine.engine import check_device_available

        check_device_available(engine_args.resolve_device())
        self.config, self.plan = resolve_deployment(engine_args)
        if self.config.parallel_config.splitwise_role != "mixed":
            raise ValueError(
                f"--splitwise-role={self.config.parallel_config.splitwise_role!r} is not "
                "supported behind Dynamo yet; allowed: mixed"
            )
        source = self.config.model_source
        self.card_dir = model_card_dir(source)
        self.engine: AsyncLLMEngine | None = None
        self._streams: dict[str, Any] = {}
        self._load_task: asyncio.Task | None = None
        self._snapshots: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    async def from_args(
        cls, argv: list[str] | None = None
    ) -> tuple[FastDeployEngine, WorkerConfig]:
        """Parse ``argv`` (``sys.argv[1:]`` when None); the engine (not started) and Dynamo's
        worker config (endpoint, discovery, planes; token input, chat and completions)."""
        return cls.from_parsed(make_worker_parser().parse_args(argv))

    @classmethod
    def from_parsed(cls, args: argparse.Namespace) -> tuple[FastDeployEngine, WorkerConfig]:
        """:meth:`from_args` for an already parsed command line."""
        namespace, component, endpoint = parse_endpoint(args.endpoint)
        engine = cls(args)
        config = WorkerConfig(
            namespace=namespace,
            component=component,
            endpoint=endpoint,
            model_name=engine.card_dir,
            served_model_name=served_name(args),
            model_input=ModelInput.Tokens,
            discovery_backend=args.discovery_backend,
            request_plane=args.request_plane,
            event_plane=args.event_plane,
        )
        return engine, config

    async def start(self, worker_id: int) -> EngineConfig:
        """Load the model and start the engine loop (as ``fastdeploy serve`` does); returns what
        Dynamo registers: the model directory, its served name, context length, our KV block
        size (the router hashes prompts in blocks of it) and pool size, and the batch limits."""
        core = await asyncio.to_thread(place_engine, self.args, self.config, self.plan)
        self.engine = AsyncLLMEngine(
            core,
            max_concurrency=self.args.max_concurrency,
            engine_stall_timeout_s=self.args.engine_stall_timeout,
        )
        self.engine.start()
        self._loop = asyncio.get_running_loop()
        if self._snapshots is not None:
            self._start_load()
        sched, cache = self.config.scheduler_config, self.config.cache_config
        logger.info(
            "worker %s serves %s (block size %d, context %d)",
            worker_id,
            served_name(self.args),
            cache.block_size,
            self.engine.max_model_len,
        )
        return EngineConfig(
            model=self.card_dir,
            served_model_name=served_name(self.args),
            llm=LlmRegistration(
                context_length=self.engine.max_model_len,
                kv_cache_block_size=cache.block_size,
                total_kv_blocks=cache.num_gpu_blocks_override,
                max_num_seqs=sched.max_num_seqs,
                max_num_batched_tokens=sched.max_num_batched_tokens,
            ),
        )

    async def kv_event_sources(self) -> list[ZmqSource]:
        """Our KV-event PUB socket (vLLM's format), which Dynamo's ``Worker`` subscribes to and
        relays to the KV router; none when events are off."""
        events = self.config.kv_events_config
        if not (events.enable_kv_cache_events and events.publisher == "zmq"):
            return []
        endpoint = events.endpoint.replace("*", "127.0.0.1").replace("[::]", "127.0.0.1")
        return [ZmqSource(endpoint=endpoint, topic=events.topic)]

    def component_metrics_dp_ranks(self) -> list[int]:
        """One rank (0): we send load snapshots for it (:meth:`_publish_load`)."""
        return [0]

    def attach_snapshot_publisher(self, publisher: Any) -> None:
        """Keep Dynamo's snapshot publisher; :meth:`start` begins sending load to it."""
        self._snapshots = publisher
        if self._loop is not None:  # called from a Dynamo thread: start the task on our loop
            self._loop.call_soon_threadsafe(self._start_load)

    def _start_load(self) -> None:
        if self._load_task is None and self.engine is not None:
            self._load_task = asyncio.get_running_loop().create_task(self._publish_load())

    async def _publish_load(self) -> None:
        """Every :data:`LOAD_EVERY_S`: KV blocks in use and the pool's size from the engine's
        stats, as Dynamo's per-rank snapshot (the router's load input)."""
        failed = False
        while True:
            await asyncio.sleep(LOAD_EVERY_S)
            stats = self.engine.stats if self.engine is not None else {}
            total = stats.get("num_total_blocks")
            if not total:
                continue
            snap = ComponentSnapshot(
                kv_used_blocks=int(total - stats.get("num_free_blocks", total)),
                kv_total_blocks=int(total),
                gpu_cache_usage=float(stats.get("kv_cache_usage", 0.0)),
                dp_rank=0,
            )
            try:
                self._snapshots.publish(0, snap)
            except Exception as e:  # the Rust binding raises a bare Exception
                if not failed:
                    logger.warning("load snapshot not accepted by Dynamo: %s", e)
                failed = True

    async def generate(self, request: dict, context: Any) -> AsyncGenerator[dict, None]:
        """Run one request; yield Dynamo chunks (:func:`~.request_map.to_chunk`).

        Raises:
            InvalidArgument: a request we cannot honour (:func:`~.request_map.to_sampling_params`
                or our admission check), before any token; Dynamo answers 400.
            HttpError: 429 when ``--max-concurrency`` requests are in flight, 503 when the
                engine has stopped.
        """
        if self.engine is None:
            raise HttpError(503, "the engine has not started")
        request_id = context.id() or uuid.uuid4().hex
        try:
            prompt, params = to_sampling_params(request, self.engine.max_model_len)
            stream = self.engine.add_request(request_id, prompt, params)
        except QueueFullError as e:
            raise HttpError(429, str(e)) from None
        except EngineDeadError as e:
            raise HttpError(503, str(e)) from None
        except ValueError as e:
            raise InvalidArgument(str(e)) from None
        self._streams[request_id] = stream
        logger.info("request %s: %d prompt tokens admitted", request_id, len(prompt))
        try:
            async for output in stream:
                yield to_chunk(output)
                if output.finished:
                    seq = output.outputs[0]
                    logger.info(
                        "request %s: %d prompt tokens, %d from the prefix cache, %d generated, %s",
                        request_id,
                        len(output.prompt_token_ids),
                        output.num_cached_tokens,
                        len(seq.token_ids),
                        seq.finish_reason,
                    )
        except EngineDeadError as e:
            yield error_chunk(str(e))
        finally:
            self._streams.pop(request_id, None)
            stream.close()  # aborts it (frees its KV blocks) unless it finished

    async def abort(self, context: Any) -> None:
        """The request's client went away or Dynamo stopped it: abort it in the engine (its KV
        blocks are freed in the engine's next step). A finished or unknown request: nothing."""
        stream = self._streams.pop(context.id(), None)
        if stream is not None:
            logger.info("request %s: aborted by Dynamo", context.id())
            stream.close()

    async def cleanup(self) -> None:
        """Drain, then stop: let the requests in flight finish for up to
        ``--timeout-graceful-shutdown`` seconds (Dynamo 1.6's ``Worker`` calls this after
        unregistering the worker and its grace period, while the responses can still be sent;
        it does not wait for an aggregated worker's requests itself), abort the rest (their KV
        blocks are freed), stop the load task, and shut the engine down (its process ends).
        Safe after a failed ``start`` and when called twice."""
        grace_s = float(self.args.timeout_graceful_shutdown)
        if self.engine is not None and self.engine.num_in_flight:
            logger.info("draining %d requests (up to %.0f s)", self.engine.num_in_flight, grace_s)
            deadline = time.monotonic() + grace_s
            while self.engine.num_in_flight and time.monotonic() < deadline:
                await asyncio.sleep(DRAIN_POLL_S)
            if self.engine.num_in_flight:
                ended = self.engine.fail_in_flight("the worker is shutting down")
                logger.warning("%d requests still running after %.0f s: aborted", ended, grace_s)
        if self._load_task is not None:
            self._load_task.cancel()
            self._load_task = None
        if self.engine is not None:
            engine, self.engine = self.engine, None
            await engine.shutdown(timeout_s=grace_s)
        if self._events_dir is not None:
            self._events_dir.cleanup()
            self._events_dir = None


def run_worker(args: argparse.Namespace) -> int:
    """Run the worker of ``args`` (:func:`~.args.make_worker_parser`) until SIGTERM or SIGINT
    (Dynamo's ``Worker`` unregisters it, then calls ``cleanup``, which drains); returns the exit
    status: 0, or 2 for a bad flag, model or plan (one ``error: ...`` line, before the model
    loads). ``python -m fastdeploy.integrations.dynamo`` and ``fastdeploy dynamo-worker`` run it
    (through :func:`~.launch.run_from_args`)."""
    import sys

    from dynamo.common.backend.run import run

    try:
        engine_and_config = FastDeployEngine.from_parsed(args)
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    async def factory(_argv: list[str] | None) -> tuple[FastDeployEngine, WorkerConfig]:
        return engine_and_config

    run(FastDeployEngine, None, engine_factory=factory)
    return 0
