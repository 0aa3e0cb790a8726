"""Prometheus metrics of the serving engine, in a registry owned by the server.

Each :class:`ServerMetrics` owns its own :class:`prometheus_client.CollectorRegistry` rather than
the process-global default one, so tests (and one process hosting several servers) can create as
many as they like without "duplicated timeseries" errors. Names follow FastDeploy's
``fastdeploy:`` metrics (``fastdeploy:num_requests_running``,
``fastdeploy:time_to_first_token_seconds``, ...). Every series is one row of :data:`METRICS`
(attribute, type, name, help, labels, buckets); a new series is a new row.

Latencies are in seconds. The engine-side numbers (running/waiting requests, KV cache usage, steps
by graph mode, padded tokens, CUDA graphs captured/planned/failed, start-up phases, preemptions,
the host KV tier's hits, swap-ins and stores) come from ``LLMEngine.get_stats()`` snapshots; the
engine reports counts cumulatively, so :meth:`ServerMetrics.observe_stats` adds the difference
to the Prometheus counters.

:meth:`ServerMetrics.render` also exports vLLM's names for the series that fleet layers read
(``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``, ...): they are copies made from the
table in :mod:`fastdeploy.metrics.vllm_names`.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric

from fastdeploy.metrics.vllm_names import vllm_families

GRAPH_MODES = ("full", "piecewise", "eager")
FINISH_REASONS = ("stop", "length", "abort", "error")
#: Why a request was refused before it reached the engine (``fastdeploy:request_rejected``):
#: a bad field or malformed HTTP (400), a prompt with no room for output (400
#: ``context_length_exceeded``), an unknown model (404), ``--max-concurrency`` reached (429), the
#: engine loop stopped (503); the request limits (:mod:`fastdeploy.entrypoints.openai.limits`):
#: too many headers or too large a header block (431), too large a body (413), a request not
#: received in time (408), stop conditions over their caps (400); a missing or wrong
#: ``--api-key`` (401).
REJECT_REASONS = (
    "invalid",
    "context_length",
    "model_not_found",
    "queue_full",
    "unavailable",
    "header_count",
    "header_size",
    "body_size",
    "read_timeout",
    "stop_limit",
    "unauthorized",
)

#: Labels of ``fastdeploy:cache_config_info`` (vLLM's ``vllm:cache_config_info`` labels, the
#: ones we know): tokens per block, and the device and host pools' blocks (null block included).
CACHE_CONFIG_LABELS = ("block_size", "num_gpu_blocks", "num_cpu_blocks")
#: Labels of ``fastdeploy:lora_requests_info``, vLLM's (we serve no LoRA adapters: "0", "", "").
LORA_INFO_LABELS = ("max_lora", "running_lora_adapters", "waiting_lora_adapters")

#: How the engine's gauges combine over several API server processes (``--api-server-count``,
#: Prometheus multiprocess mode): only the primary process sets them, the others leave them 0.
ENGINE_GAUGE_MODE = "max"

# Buckets in seconds; the same ladders vLLM and FastDeploy use for these three histograms.
# fmt: off
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0)
# fmt: on


@dataclass(frozen=True)
class MetricSpec:
    """One row of :data:`METRICS`: a series :class:`ServerMetrics` declares.

    Attributes:
        attr: the :class:`ServerMetrics` attribute that holds it.
        kind: :class:`~prometheus_client.Counter`, :class:`~prometheus_client.Gauge` or
            :class:`~prometheus_client.Histogram`. Gauges are the engine's: combined over API
            server processes with :data:`ENGINE_GAUGE_MODE`.
        name: the series name (a counter is exported with ``_total`` appended).
        help: its help text.
        labels: label names (at most one where ``presets`` is given).
        buckets: a histogram's bucket upper bounds (seconds).
        presets: values of the one label whose series exist from the start (at 0).
    """

    attr: str
    kind: type
    name: str
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None
    presets: tuple[str, ...] = ()

    def create(self, registry: CollectorRegistry) -> Any:
        """The metric, registered in ``registry``, with its preset series."""
        kwargs: dict[str, Any] = {"registry": registry}
        if self.kind is Gauge:
            kwargs["multiprocess_mode"] = ENGINE_GAUGE_MODE
        if self.buckets is not None:
            kwargs["buckets"] = self.buckets
        metric = self.kind(self.name, self.help, list(self.labels), **kwargs)
        for value in self.presets:
            metric.labels(value)
        return metric


M = MetricSpec
#: Every series of :class:`ServerMetrics`, one row each, in registration (and export) order.
# fmt: off
METRICS: tuple[MetricSpec, ...] = (
    M("requests", Counter, "fastdeploy:request_success",
      "Finished requests by finish reason.", ("finished_reason",), presets=FINISH_REASONS),
    M("rejected", Counter, "fastdeploy:request_rejected",
      "Requests refused with an HTTP error before reaching the engine, by reason.",
      ("reason",), presets=REJECT_REASONS),
    M("num_running", Gauge, "fastdeploy:num_requests_running", "Requests in the running batch."),
    M("num_waiting", Gauge, "fastdeploy:num_requests_waiting",
      "Requests waiting to be scheduled."),
    M("kv_cache_usage", Gauge, "fastdeploy:gpu_cache_usage_perc",
      "KV cache usage, 0..1 (1 = all blocks used)."),
    M("free_blocks", Gauge, "fastdeploy:num_free_kv_blocks", "Free KV cache blocks."),
    M("total_blocks", Gauge, "fastdeploy:num_total_kv_blocks", "KV cache blocks in the pool."),
    M("cache_config_info", Gauge, "fastdeploy:cache_config_info",
      "KV cache configuration as labels; value 1.", CACHE_CONFIG_LABELS),
    M("lora_requests_info", Gauge, "fastdeploy:lora_requests_info",
      "LoRA adapters running and waiting (none are served); value: the time of the last "
      "update (s since the epoch).", LORA_INFO_LABELS),
    M("prefix_cache_queries", Counter, "fastdeploy:prefix_cache_queries",
      "Prompt tokens looked up in the prefix cache at admission."),
    M("prefix_cache_hits", Counter, "fastdeploy:prefix_cache_hits",
      "Prompt tokens found in the prefix cache at admission."),
    M("prompt_tokens", Counter, "fastdeploy:prompt_tokens", "Prompt tokens prefilled."),
    M("generation_tokens", Counter, "fastdeploy:generation_tokens", "Tokens generated."),
    M("ttft", Histogram, "fastdeploy:time_to_first_token_seconds", "Time to first token (s).",
      buckets=TTFT_BUCKETS),
    M("tpot", Histogram, "fastdeploy:time_per_output_token_seconds",
      "Time per output token after the first (s), one observation per streamed token.",
      buckets=TPOT_BUCKETS),
    M("e2e", Histogram, "fastdeploy:e2e_request_latency_seconds",
      "End-to-end request latency (s).", buckets=E2E_BUCKETS),
    M("steps", Counter, "fastdeploy:steps",
      "Engine steps by graph mode (full, piecewise, eager).", ("mode",), presets=GRAPH_MODES),
    M("preemptions", Counter, "fastdeploy:num_preemptions",
      "Requests preempted by recompute because the KV cache was full (a request preempted "
      "twice counts twice)."),
    M("padded_tokens", Counter, "fastdeploy:padded_tokens",
      "Tokens added to pad batches up to a capture size."),
    M("graphs_captured", Gauge, "fastdeploy:cuda_graph_buckets_captured",
      "CUDA graphs captured and replayed (prefill and decode buckets, sampled-row graphs); "
      "grows while the engine captures in the background."),
    M("graphs_total", Gauge, "fastdeploy:cuda_graph_buckets_planned",
      "CUDA graphs the plan captures (0 without graphs); not `_total`, which Prometheus "
      "keeps for counters."),
    M("startup_seconds", Gauge, "fastdeploy:startup_phase_seconds",
      "Seconds each start-up phase took (imports, config_and_plan, tokenizer, workers, weights, "
      "memory_profile, kv_allocation, kernel_warmup, capture_before_serving, warmup_other; "
      "background_capture_phase_1/2 while and after graphs are captured while serving).",
      ("phase",)),
    M("graphs_failed", Gauge, "fastdeploy:cuda_graph_buckets_failed",
      "CUDA graphs whose capture raised (out of memory, say): their buckets run eagerly."),
    # Prefill/decode disaggregation (exported only by a prefill or decode node's engine).
    M("pd_pending_sends", Gauge, "fastdeploy:pd_pending_sends",
      "Finished prefill-leg requests whose KV blocks wait for a decode node."),
    M("pd_pending_send_blocks", Gauge, "fastdeploy:pd_pending_send_blocks",
      "KV blocks held for decode nodes (pending sends)."),
    M("pd_released", Counter, "fastdeploy:pd_pending_sends_released",
      "Pending sends released, by reason (done, abort, expired).", ("reason",)),
    M("pd_claims", Counter, "fastdeploy:pd_claims", "CLAIMs answered by this prefill node."),
    M("pd_auth_rejected", Counter, "fastdeploy:pd_auth_rejected",
      "PD side-channel messages and tcp KV reads refused by the PD secret check, by reason "
      "(unsigned, malformed, bad_signature, stale, replayed).", ("reason",)),
    M("pd_connections_refused", Counter, "fastdeploy:pd_connections_refused",
      "PD connections refused over --pd-max-connections, by listener (side_channel, kv).",
      ("listener",)),
    M("num_waiting_for_remote_kv", Gauge, "fastdeploy:num_requests_waiting_for_remote_kv",
      "Decode-leg requests holding blocks while their KV is pulled."),
    M("kv_transfers", Counter, "fastdeploy:kv_transfers",
      "KV pulls completed by this decode node."),
    M("kv_transfer_bytes", Counter, "fastdeploy:kv_transfer_bytes",
      "Bytes of KV pulled by this decode node."),
    M("kv_transfer_seconds", Counter, "fastdeploy:kv_transfer_seconds",
      "Seconds spent in completed KV pulls (claim, read, done)."),
    M("kv_transfer_failures", Counter, "fastdeploy:kv_transfer_failures",
      "Failed KV pulls, by reason (claim, transfer, cancelled).", ("reason",)),
    # Host KV tier (exported only with --swap-space).
    M("host_cache_hit_tokens", Counter, "fastdeploy:host_cache_hit_tokens",
      "Prompt tokens found in the host KV tier at admission (swapped in, not recomputed)."),
    M("swap_in_bytes", Counter, "fastdeploy:swap_in_bytes",
      "Bytes of KV copied from the host tier back."),
    M("swap_in_seconds", Counter, "fastdeploy:swap_in_seconds",
      "Seconds from issuing swap-ins until the engine saw them land (step granularity)."),
    M("host_store_bytes", Counter, "fastdeploy:host_store_bytes",
      "Bytes of KV written through to the host tier (landed stores)."),
    M("host_pending_stores", Gauge, "fastdeploy:host_pending_stores",
      "KV blocks whose copy to the host tier is in flight (their device blocks are held)."),
    M("host_cache_usage", Gauge, "fastdeploy:host_cache_usage_perc",
      "Host KV tier usage, 0..1 (1 = all host blocks used)."),
    M("num_waiting_for_swap_in", Gauge, "fastdeploy:num_requests_waiting_for_swap_in",
      "Requests holding blocks while their host-tier hits are copied back."),
    M("engine_stalled", Gauge, "fastdeploy:engine_stalled",
      "1 while the engine has not finished a step for longer than --engine-stall-timeout "
      "with work to do (/health answers 503), else 0."),
)
# fmt: on
del M


class ServerMetrics:
    """All metrics of one server, registered in ``self.registry``.

    Thread-safety: prometheus_client metrics are thread-safe; :meth:`observe_stats` keeps the
    previous cumulative counts and must be called from one thread (the server's asyncio thread).

    Several API server processes (``--api-server-count``) share one engine: each records its own
    requests (TTFT, TPOT, latency, tokens, finishes, refusals) and the primary alone records the
    engine's counters and gauges (``engine_stats``), which every process receives; with
    ``multiprocess_dir`` the values live in prometheus_client's multiprocess files there
    (``PROMETHEUS_MULTIPROC_DIR``, set before prometheus_client is imported) and :meth:`render`
    sums the processes' counters and histograms.

    Every row of :data:`METRICS` is registered and held as the attribute its ``attr`` names
    (``self.ttft``, ``self.steps``, ...).

    Args:
        registry: where the metrics are registered (a new registry by default).
        multiprocess_dir: the ``PROMETHEUS_MULTIPROC_DIR`` of the server's processes, or None.
        engine_stats: whether :meth:`observe_stats` records (False in the non-primary API
            server processes).
        model_name: the served model name, vLLM's ``model_name`` label on the ``vllm:`` series.

    Raises:
        RuntimeError: ``multiprocess_dir`` given, but prometheus_client was imported without
            ``PROMETHEUS_MULTIPROC_DIR`` set (its values would not be shared).
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        multiprocess_dir: str | None = None,
        engine_stats: bool = True,
        model_name: str = "",
    ) -> None:
        if multiprocess_dir is not None:
            from prometheus_client import values

            if not getattr(values.ValueClass, "__name__", "").startswith("MmapedValue"):
                raise RuntimeError(
                    "prometheus_client was imported before PROMETHEUS_MULTIPROC_DIR was set; "
                    "set it before the server starts"
                )
        self.multiprocess_dir = multiprocess_dir
        self.model_name = model_name
        self.engine_stats = engine_stats
        self.registry = registry if registry is not None else CollectorRegistry()
        for spec in METRICS:
            setattr(self, spec.attr, spec.create(self.registry))
        self._last_totals: dict[str, float] = {}
        self._last_steps: dict[str, int] = {}
        self._last_padded = 0
        self._cache_config: tuple[str, ...] | None = None

    def observe_stats(self, stats: dict) -> None:
        """Update gauges and counters from one ``LLMEngine.get_stats()`` snapshot.

        Unknown or missing keys are skipped, so a partial snapshot is fine. Nothing is recorded
        where ``engine_stats`` is False.
        """
        if not self.engine_stats:
            return
        if "num_running" in stats:
            self.num_running.set(stats["num_running"])
        if "num_waiting" in stats:
            self.num_waiting.set(stats["num_waiting"])
        if "kv_cache_usage" in stats:
            self.kv_cache_usage.set(stats["kv_cache_usage"])
        if "num_free_blocks" in stats:
            self.free_blocks.set(stats["num_free_blocks"])
        if "num_total_blocks" in stats:
            self.total_blocks.set(stats["num_total_blocks"])
        for mode, count in (stats.get("steps_by_mode") or {}).items():
            delta = count - self._last_steps.get(mode, 0)
            if delta > 0:
                self.steps.labels(mode=mode).inc(delta)
            self._last_steps[mode] = count
        if "num_preemptions" in stats:
            self._inc_to("num_preemptions", self.preemptions, stats["num_preemptions"])
        if "prefix_cache_queries" in stats:
            self._inc_to("prefix_queries", self.prefix_cache_queries, stats["prefix_cache_queries"])
            self._inc_to("prefix_hits", self.prefix_cache_hits, stats["prefix_cache_hits"])
        self._observe_info(stats)
        if "num_waiting_for_remote_kv" in stats:
            self.num_waiting_for_remote_kv.set(stats["num_waiting_for_remote_kv"])
        pd = stats.get("pd")
        if pd:
            self._observe_pd(pd)
        self._observe_host_tier(stats)
        capture = stats.get("graph_capture")
        if capture:
            self.graphs_captured.set(capture["captured"])
            self.graphs_total.set(capture["total"])
            self.graphs_failed.set(capture["failed"])
            if capture.get("background"):
                for phase, seconds in (capture.get("seconds_by_phase") or {}).items():
                    self.startup_seconds.labels(f"background_capture_phase_{phase}").set(seconds)
        for phase, seconds in (stats.get("startup_seconds") or {}).items():
            self.startup_seconds.labels(phase).set(seconds)
        padded = stats.get("num_padded_tokens")
        if padded is not None:
            if padded > self._last_padded:
                self.padded_tokens.inc(padded - self._last_padded)
            self._last_padded = padded

    def _observe_info(self, stats: dict) -> None:
        """The two info series: the cache configuration (labels, value 1; a changed pool
        replaces the old series) and the LoRA adapters (none; value: now)."""
        if "num_gpu_blocks" in stats:
            host = stats.get("num_host_blocks")
            labels = (
                str(stats["block_size"]),
                str(stats["num_gpu_blocks"]),
                str(int(host) if host is not None else 0),
            )
            if labels != self._cache_config:
                if self._cache_config is not None:
                    self.cache_config_info.remove(*self._cache_config)
                self.cache_config_info.labels(*labels).set(1)
                self._cache_config = labels
        self.lora_requests_info.labels("0", "", "").set(time.time())

    def _inc_to(self, key: str, counter: Any, total: float) -> None:
        """Advance ``counter`` to a cumulative ``total`` reported by the engine."""
        delta = total - self._last_totals.get(key, 0)
        if delta > 0:
            counter.inc(delta)
        self._last_totals[key] = total

    def _observe_pd(self, pd: dict) -> None:
        if "pending_sends" in pd:
            self.pd_pending_sends.set(pd["pending_sends"])
            self.pd_pending_send_blocks.set(pd["pending_send_blocks"])
            self._inc_to("claims", self.pd_claims, pd.get("claims_total", 0))
            for reason, key in (("done", "done"), ("abort", "aborts"), ("expired", "expired")):
                total = pd.get(f"{key}_total", 0)
                self._inc_to(f"released_{reason}", self.pd_released.labels(reason=reason), total)
        if "transfers" in pd:
            self._inc_to("transfers", self.kv_transfers, pd["transfers"])
            self._inc_to("bytes", self.kv_transfer_bytes, pd["transfer_bytes"])
            self._inc_to("seconds", self.kv_transfer_seconds, pd["transfer_seconds"])
            for reason, total in (pd.get("failures") or {}).items():
                counter = self.kv_transfer_failures.labels(reason=reason)
                self._inc_to(f"failures_{reason}", counter, total)
        for reason, total in (pd.get("auth_rejected") or {}).items():
            counter = self.pd_auth_rejected.labels(reason=reason)
            self._inc_to(f"auth_rejected_{reason}", counter, total)
        for listener, total in (pd.get("connections_refused") or {}).items():
            counter = self.pd_connections_refused.labels(listener=listener)
            self._inc_to(f"connections_refused_{listener}", counter, total)

    def _observe_host_tier(self, stats: dict) -> None:
        if "host_cache_hit_tokens" not in stats:
            return
        self._inc_to("host_hit_tokens", self.host_cache_hit_tokens, stats["host_cache_hit_tokens"])
        self._inc_to("swap_in_bytes", self.swap_in_bytes, stats["swap_in_bytes"])
        self._inc_to("swap_in_seconds", self.swap_in_seconds, stats["swap_in_seconds"])
        self._inc_to("host_store_bytes", self.host_store_bytes, stats["host_store_bytes"])
        self.host_pending_stores.set(stats["host_pending_stores"])
        self.host_cache_usage.set(stats["host_cache_usage"])
        self.num_waiting_for_swap_in.set(stats.get("num_waiting_for_swap_in", 0))

    def observe_stalled(self, stalled: bool) -> None:
        """The engine became stalled (True) or made progress again (False); recorded where
        ``engine_stats`` is True, as the engine's other gauges."""
        if self.engine_stats:
            self.engine_stalled.set(1 if stalled else 0)

    def observe_first_token(self, ttft_s: float, num_prompt_tokens: int) -> None:
        """A request's prefill finished and its first token came out."""
        self.ttft.observe(ttft_s)
        self.prompt_tokens.inc(num_prompt_tokens)

    def observe_tokens(self, num_tokens: int, interval_s: float | None) -> None:
        """``num_tokens`` new tokens of one request; ``interval_s`` since its previous tokens."""
        self.generation_tokens.inc(num_tokens)
        if interval_s is not None and num_tokens > 0:
            per_token = interval_s / num_tokens
            for _ in range(num_tokens):
                self.tpot.observe(per_token)

    def observe_step_tokens(self, tokens: StepTokens) -> None:
        """One engine step's new tokens over all requests, recorded at once: the same counts as
        :meth:`observe_tokens` per request, with one lock per distinct TPOT value instead of two
        per token (most requests of a step share their interval since the previous step)."""
        if tokens.num_tokens:
            self.generation_tokens.inc(tokens.num_tokens)
        for per_token, count in tokens.tpot.items():
            _observe_many(self.tpot, per_token, count)

    def observe_finish(self, finish_reason: str, e2e_s: float) -> None:
        """A request left the engine with ``finish_reason`` (stop, length, abort or error)."""
        self.requests.labels(finished_reason=finish_reason).inc()
        self.e2e.observe(e2e_s)

    def observe_rejected(self, reason: str) -> None:
        """A request was refused with an HTTP error, for ``reason`` (one of
        :data:`REJECT_REASONS`)."""
        self.rejected.labels(reason=reason).inc()

    def render(self) -> bytes:
        """The registry in Prometheus text format (with ``multiprocess_dir``: every process's
        values, combined), followed by the ``vllm:`` copies of the mapped series
        (:func:`~fastdeploy.metrics.vllm_names.vllm_families`)."""
        if self.multiprocess_dir is None:
            families = list(self.registry.collect())
        else:
            from prometheus_client import multiprocess

            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry, path=self.multiprocess_dir)
            families = list(registry.collect())
        families += vllm_families(families, self.model_name)
        return generate_latest(_Families(families))


class _Families:
    """Collected metric families, in the shape :func:`generate_latest` reads (``collect()``)."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


class StepTokens:
    """The token observations of one engine step, for :meth:`ServerMetrics.observe_step_tokens`:
    ``num_tokens`` generated, and ``tpot`` {seconds per output token: number of tokens}."""

    __slots__ = ("num_tokens", "tpot")

    def __init__(self) -> None:
        self.num_tokens = 0
        self.tpot: dict[float, int] = {}

    def add(self, num_tokens: int, interval_s: float | None) -> None:
        """``num_tokens`` new tokens of one request; ``interval_s`` since its previous tokens
        (None for its first token, which has no TPOT)."""
        self.num_tokens += num_tokens
        if interval_s is not None and num_tokens > 0:
            per_token = interval_s / num_tokens
            self.tpot[per_token] = self.tpot.get(per_token, 0) + num_tokens


def _observe_many(histogram: Histogram, value: float, count: int) -> None:
    """``histogram.observe(value)`` ``count`` times, taking two locks in all.

    prometheus_client's ``Histogram.observe`` has no count, so this adds to the histogram's sum
    and bucket values directly (``_upper_bounds``, ``_buckets``, ``_sum``: its layout since
    0.0.x); it observes one by one where the layout differs.
    """
    try:
        bounds, buckets, total = histogram._upper_bounds, histogram._buckets, histogram._sum
    except AttributeError:
        for _ in range(count):
            histogram.observe(value)
        return
    total.inc(value * count)
    buckets[bisect_left(bounds, value)].inc(count)  # the first bucket with value <= bound
