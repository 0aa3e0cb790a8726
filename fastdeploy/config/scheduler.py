"""Continuous batching limits and the overlap schedule switch: :class:`SchedulerConfig`."""

from __future__ import annotations

import math
from dataclasses import dataclass

from fastdeploy.config.checks import check, check_int, is_number


@dataclass
class SchedulerConfig:
    """Continuous batching limits. ``max_num_batched_tokens`` is the per-step token budget.

    ``disable_overlap_schedule`` turns off the overlap schedule (SGLang's flag): by default the
    host schedules and prepares step N+1 while the device runs step N, where the graph policy
    finds it supported (its plan says whether it is on, and why not).

    ``scheduler_delay_factor`` (vLLM's ``--scheduler-delay-factor``, same meaning): while requests
    are running, waiting prompts are admitted only once the oldest of them has waited more than
    this many times the last prompt latency (the interval from the scheduling call that admitted
    prompts to the next call, about one step), so that prompts arriving a few steps apart share
    one mixed step instead of each paying for one. 0 (the default) admits them at once. It
    trades time to first token for fewer prefill steps: see the scheduler module.

    ``None`` is resolved by ``EngineArgs.create_engine_config``: with chunked prefill to
    ``max(2048, max_num_seqs)``; without it to ``max(max_model_len, 2048, max_num_seqs)`` (a whole
    prompt must fit one step). Cross-field limits are checked by :meth:`FDConfig.validate`.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    disable_overlap_schedule: bool = False
    scheduler_delay_factor: float = 0.0

    def __post_init__(self) -> None:
        check_int("max_num_seqs", self.max_num_seqs)
        factor = self.scheduler_delay_factor
        check(
            is_number(factor) and math.isfinite(factor) and factor >= 0,
            "scheduler_delay_factor",
            factor,
            "a finite number >= 0 (0: admit waiting prompts at once)",
        )
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, optional=True)
        for name in ("enable_chunked_prefill", "disable_overlap_schedule"):
            value = getattr(self, name)
            check(isinstance(value, bool), name, value, "true or false")
