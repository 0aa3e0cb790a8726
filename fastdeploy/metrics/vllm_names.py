"""vLLM's metric names beside ours: one table, and the series it produces at render time.

Fleet layers read vLLM's series by default. For example, llm-d's endpoint picker scrapes
``vllm:num_requests_waiting``, ``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc``,
``vllm:cache_config_info`` and ``vllm:lora_requests_info``. Each row of :data:`VLLM_NAMES` names
one of our ``fastdeploy:`` series and the vLLM name that carries the same values. At render time,
:func:`vllm_families` copies each mapped family under the vLLM name, after the API server
processes' values have been combined. The copy has the same type, buckets and samples, and adds
vLLM's server labels (``model_name``, ``engine``). Nothing is recorded twice, so the two names of
a pair cannot disagree.

Names, types, label names and units follow vLLM v0.11 (``vllm/v1/metrics/loggers.py``,
``PrometheusStatLogger``):

- ``vllm:kv_cache_usage_perc`` is a fraction, 0 to 1, as ours is.
- ``vllm:prefix_cache_queries`` and ``vllm:prefix_cache_hits`` count tokens.
- ``vllm:time_per_output_token_seconds`` is the deprecated name of
  ``vllm:inter_token_latency_seconds``, and both are exported. Our histogram observes each
  streamed token's interval, which is what these two measure.
- The two info series, ``vllm:cache_config_info`` (value 1) and ``vllm:lora_requests_info``
  (value = the time of the last update, in seconds since the epoch), keep only their own labels
  and ``engine``, as vLLM's do.

Not mapped: vLLM's per-request ``vllm:request_time_per_output_token_seconds``, and its queue,
prefill and decode phase histograms. We record none of them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client.metrics_core import Metric

#: vLLM's label for the engine index; one engine per server here, so always "0".
ENGINE_INDEX = "0"


@dataclass(frozen=True)
class VllmName:
    """One row of :data:`VLLM_NAMES`.

    Attributes:
        fastdeploy: our series (a family name, without ``_total``).
        vllm: vLLM's series carrying the same values (a family name, without ``_total``).
        server_labels: whether vLLM labels it with ``model_name`` and ``engine``. False for info
            series, which get only ``engine``.
    """

    fastdeploy: str
    vllm: str
    server_labels: bool = True


V = VllmName
#: Every vLLM series we export, and the ``fastdeploy:`` series it copies.
# fmt: off
VLLM_NAMES: tuple[VllmName, ...] = (
    V("fastdeploy:num_requests_running", "vllm:num_requests_running"),
    V("fastdeploy:num_requests_waiting", "vllm:num_requests_waiting"),
    V("fastdeploy:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc"),
    V("fastdeploy:cache_config_info", "vllm:cache_config_info", server_labels=False),
    V("fastdeploy:lora_requests_info", "vllm:lora_requests_info", server_labels=False),
    V("fastdeploy:time_to_first_token_seconds", "vllm:time_to_first_token_seconds"),
    V("fastdeploy:time_per_output_token_seconds", "vllm:time_per_output_token_seconds"),
    V("fastdeploy:time_per_output_token_seconds", "vllm:inter_token_latency_seconds"),
    V("fastdeploy:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds"),
    V("fastdeploy:prompt_tokens", "vllm:prompt_tokens"),
    V("fastdeploy:generation_tokens", "vllm:generation_tokens"),
    V("fastdeploy:request_success", "vllm:request_success"),
    V("fastdeploy:prefix_cache_queries", "vllm:prefix_cache_queries"),
    V("fastdeploy:prefix_cache_hits", "vllm:prefix_cache_hits"),
    V("fastdeploy:num_preemptions", "vllm:num_preemptions"),
)
# fmt: on
del V

#: vLLM name -> our name (each vLLM name has one source).
FASTDEPLOY_OF: dict[str, str] = {row.vllm: row.fastdeploy for row in VLLM_NAMES}
#: Our name -> its vLLM names (one of ours may carry two vLLM names).
VLLM_OF: dict[str, tuple[str, ...]] = {}
for _row in VLLM_NAMES:
    VLLM_OF[_row.fastdeploy] = (*VLLM_OF.get(_row.fastdeploy, ()), _row.vllm)
del _row


def vllm_families(families: Iterable[Metric], model_name: str) -> list[Metric]:
    """The vLLM-named copies of the mapped families among ``families``.

    Args:
        families: collected ``fastdeploy:`` metric families, for example
            ``registry.collect()``, or a multiprocess collector's combined output.
        model_name: the served model name (vLLM's ``model_name`` label).

    Returns:
        One new family per row of :data:`VLLM_NAMES` whose source is present, in table order.
        Each sample's name has the source prefix replaced, so ``_total``, ``_bucket``, ``_sum``,
        ``_count`` and ``_created`` keep their suffixes.
    """
    by_name = {family.name: family for family in families}
    out = []
    for row in VLLM_NAMES:
        source = by_name.get(row.fastdeploy)
        if source is None:
            continue
        extra = {"engine": ENGINE_INDEX}
        if row.server_labels:
            extra = {"model_name": model_name, **extra}
        family = Metric(row.vllm, source.documentation, source.type, source.unit)
        for sample in source.samples:
            suffix = sample.name[len(row.fastdeploy) :]
            family.add_sample(
                row.vllm + suffix,
                {**sample.labels, **extra},
                sample.value,
                sample.timestamp,
                sample.exemplar,
            )
        out.append(family)
    return out
