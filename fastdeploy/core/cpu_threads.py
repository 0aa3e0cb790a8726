"""The CPU thread settings of every process that runs engine steps: the server's engine process,
its tensor-parallel ranks, and the caller's own process for the offline ``LLM``.

Why this exists: torch's CPU kernels run on an OpenMP pool (libgomp in the PyPI wheels), and
libgomp reads ``OMP_WAIT_POLICY`` once, when torch is imported. Unset, a worker that has finished
its share of a parallel region spins for a while (about 300,000 iterations) before it sleeps. On
cores shared with other busy processes (the API server, a PD node's transport threads, other jobs
on a small CI host) the spinning workers take the time slices that the thread they wait for
needs, and a decode step of the default 135M model goes from milliseconds to tens of them.

The server has started its engine process with ``OMP_WAIT_POLICY=PASSIVE`` (sleep at once) on
CPU since it first ran the engine in a process of its own. The offline ``LLM`` runs the engine in
the caller's process, whose OpenMP pool had loaded with the default policy: the thread counts were
the same in both (torch's defaults, intra-op = inter-op = the physical cores), only the wait policy
differed, and the same request under CPU contention took 18-24 s offline against 1.7-1.9 s through
the server. Both paths now take their settings from :func:`engine_thread_env`, applied by
:func:`set_engine_thread_env` when ``fastdeploy`` is imported (before anything of it imports torch).
Measured again on a 2-core host shared with other jobs (load average ~10), one 32-token greedy
chat request on the default model: offline 33-119 s before, 4.7-5.0 s after (8.6-10.3 s in an
earlier run with the variable set by hand, as the load varied; 13.7-15.4 s with one intra-op
thread and the spinning policy); through the server 2.3-6.4 s.

This module imports no torch at import time (it must run before torch loads).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass

logger = logging.getLogger(__name__)

WAIT_POLICY_VAR = "OMP_WAIT_POLICY"
#: The wait policy of engine processes: an OpenMP worker sleeps as soon as it has no work.
ENGINE_WAIT_POLICY = "PASSIVE"

# The policy this process's OpenMP runtime loaded with, as far as fastdeploy can tell: the
# variable's value when fastdeploy was imported (before torch, or after it when the caller
# imported torch first; nothing changes the runtime after it loaded).
_UNKNOWN = object()
_loaded_wait_policy: object = _UNKNOWN
_warned = False  # the spinning runtime's warning: once a process


@dataclass(frozen=True)
class ThreadSettings:
    """What a process's torch CPU kernels run with.

    Attributes:
        num_threads: torch's intra-op threads (``torch.get_num_threads()``).
        num_interop_threads: torch's inter-op threads (``torch.get_num_interop_threads()``).
        omp_wait_policy: the ``OMP_WAIT_POLICY`` that the OpenMP runtime loaded with (``None``:
            unset, the runtime's default, which spins).
    """

    num_threads: int
    num_interop_threads: int
    omp_wait_policy: str | None


def engine_thread_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables that a process running engine steps needs before torch loads, less those
    already set in ``environ`` (default ``os.environ``): a user's own ``OMP_WAIT_POLICY`` wins.

    Returns:
        ``{"OMP_WAIT_POLICY": "PASSIVE"}`` when the variable is unset, else ``{}``.
    """
    environ = os.environ if environ is None else environ
    return {} if WAIT_POLICY_VAR in environ else {WAIT_POLICY_VAR: ENGINE_WAIT_POLICY}


def set_engine_thread_env() -> None:
    """Put :func:`engine_thread_env` into ``os.environ`` (called when ``fastdeploy`` is imported).

    Before torch loads (``import fastdeploy`` first, as the CLI and ``from fastdeploy import LLM``
    do) it sets this process's OpenMP policy; the processes this one starts (the server's engine
    process, tensor-parallel ranks) inherit it either way. Idempotent.
    """
    global _loaded_wait_policy
    before = os.environ.get(WAIT_POLICY_VAR)
    os.environ.update(engine_thread_env())
    if _loaded_wait_policy is _UNKNOWN:
        loaded_first = "torch" in sys.modules
        _loaded_wait_policy = before if loaded_first else os.environ.get(WAIT_POLICY_VAR)


def thread_settings() -> ThreadSettings:
    """This process's :class:`ThreadSettings` (imports torch)."""
    import torch

    return ThreadSettings(
        num_threads=torch.get_num_threads(),
        num_interop_threads=torch.get_num_interop_threads(),
        omp_wait_policy=None if _loaded_wait_policy is _UNKNOWN else _loaded_wait_policy,
    )


def check_engine_threads(device: str) -> ThreadSettings:
    """Check the settings of this process before it runs engine steps in-process (the offline
    ``LLM``); on CPU, warn when its OpenMP runtime spins (torch was imported before fastdeploy
    with ``OMP_WAIT_POLICY`` unset; once a process): under CPU contention every step may then take
    ~10x longer.

    Args:
        device: ``cpu``, ``cuda`` or ``auto`` (``cuda`` when available), as ``--device``.

    Returns:
        This process's :class:`ThreadSettings`.
    """
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    global _warned
    settings = thread_settings()
    if device == "cpu" and settings.omp_wait_policy is None and not _warned:
        _warned = True
        logger.warning(
            "torch was imported before fastdeploy with OMP_WAIT_POLICY unset: its OpenMP workers "
            "spin while they wait, and under CPU contention each engine step can take ~10x "
            "longer; set OMP_WAIT_POLICY=PASSIVE in the environment or import fastdeploy first"
        )
    return settings
