"""The messages that cross the process line between an API server and the engine, typed.

Commands go down (server -> engine loop): :class:`AddRequest`, :class:`AbortRequest`,
:class:`StopLoop`. Events come up (engine loop -> server): :class:`EngineReady` or
:class:`EngineStartFailed` once, before the loop starts; then :class:`EngineStats`,
:class:`StepOutputs`, :class:`RequestFailed` and :class:`EngineDead`. The same objects travel
over the engine process's pipes (pickled) and over the thread hand-off of an engine on a thread
of the server (as they are). Every end dispatches on the message's class (a dict keyed by class,
or ``match``), never on a string: a new message is a new class here and a handler at each end.

Step messages are frequent (one per engine step), so each class is a slotted dataclass that
pickles as its class and a tuple of its field values (:meth:`_Message.__reduce__`): no field
names, no ``__dict__``. A step's outputs go as they are given (an
:class:`~fastdeploy.core.outputs.EngineOutputList` from the engine process), never copied here.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from fastdeploy.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from fastdeploy.core.cpu_threads import ThreadSettings
    from fastdeploy.core.outputs import EngineOutput


class _Message:
    """Base of every message: pickles as ``(cls, field values)`` (cheaper than the default
    reduction of a slotted class, which names each field)."""

    __slots__ = ()

    def __reduce__(self) -> tuple:
        return (type(self), tuple(getattr(self, name) for name in self.__slots__))


# ---------------------------------------------------------------------- commands (down)
@dataclass(frozen=True, slots=True)
class AddRequest(_Message):
    """Queue a request that already passed the admission check.

    Attributes:
        request_id: the request's id (unique among those in flight).
        prompt_token_ids: the prompt's token ids (``list[int]``, at least one).
        sampling_params: how to sample its output.
        kv_transfer_params: the PD leg's ``kv_transfer_params`` (vLLM's dict); None for a plain
            request.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    kv_transfer_params: dict | None = None


@dataclass(frozen=True, slots=True)
class AbortRequest(_Message):
    """Abort a request and free its KV blocks (a no-op for an unknown id).

    Attributes:
        request_id: the request's id.
    """

    request_id: str


@dataclass(frozen=True, slots=True)
class StopLoop(_Message):
    """Leave the engine loop (from the one API server; with several, this one leaves)."""


Command = AddRequest | AbortRequest | StopLoop


# ---------------------------------------------------------------------- events (up)
@dataclass(frozen=True, slots=True)
class EngineStats(_Message):
    """The engine's counters, sent at start and after commands that no step follows (a step's
    own :class:`StepOutputs` carries them otherwise).

    Attributes:
        stats: ``LLMEngine.get_stats()``: ``num_running``, ``num_waiting``,
            ``num_waiting_for_remote_kv`` (requests), ``kv_cache_usage`` (fraction 0..1),
            ``num_free_blocks``, ``num_total_blocks`` (KV blocks) and more.
    """

    stats: dict


@dataclass(frozen=True, slots=True)
class StepOutputs(_Message):
    """One engine step ended.

    Attributes:
        outputs: the step's :class:`~fastdeploy.core.outputs.EngineOutput` list, one per request
            with news (an ``EngineOutputList`` when it leaves the engine process).
        stats: the engine's counters after the step (as :attr:`EngineStats.stats`).
        now: ``time.monotonic()`` in seconds when the step ended (the clock is shared by the
            processes of one host).
    """

    outputs: list[EngineOutput]
    stats: dict
    now: float


@dataclass(frozen=True, slots=True)
class RequestFailed(_Message):
    """The engine refused a queued request (its ``add_request`` raised).

    Attributes:
        request_id: the request's id.
        error: what was raised (``ValueError`` mostly), raised to the request's consumer.
    """

    request_id: str
    error: BaseException


@dataclass(frozen=True, slots=True)
class EngineDead(_Message):
    """The loop failed, or the engine process ended: no request can make progress.

    Attributes:
        error: why (the loop's exception, or ``EngineProcessExitedError``).
    """

    error: BaseException


class AdmissionCheck(Protocol):
    """What a front end checks requests against, fixed at the engine's start-up
    (:class:`~fastdeploy.engine.admission.Admission`, sent in :class:`EngineReady`)."""

    max_model_len: int
    max_model_len_note: str | None
    vocab_size: int
    splitwise_role: str

    def check(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None = None,
        kv_transfer_params: dict | None = None,
    ) -> Any:
        """Check one request; raises ``ValueError`` naming what is wrong."""

    def release_refused_leg(self, params: object) -> bool:
        """Send the ABORT of a decode leg refused before admission to its prefill node, when
        this node trusts that node; whether one was started."""


@dataclass(frozen=True, slots=True)
class EngineReady(_Message):
    """The engine process started (model loaded, KV cache sized, graphs captured); sent once,
    before the loop's first message.

    Attributes:
        admission: what requests are checked against in the server process.
        config: the resolved ``FDConfig.to_dict()``.
        deployment_plan: the engine's ``DeploymentPlan.to_dict()``.
        pid: the engine process's pid.
        threads: the engine process's CPU thread settings (``core.cpu_threads.ThreadSettings``).
    """

    admission: AdmissionCheck
    config: dict
    deployment_plan: dict
    pid: int
    threads: ThreadSettings


@dataclass(frozen=True, slots=True)
class EngineStartFailed(_Message):
    """The engine could not start (sent instead of :class:`EngineReady`; the process then exits).

    Attributes:
        error: what ``LLMEngine`` raised (``ValueError``, ``FileNotFoundError``, ``OSError``,
            ...), raised again in the server process.
    """

    error: BaseException


EngineMessage = (
    EngineStats | StepOutputs | RequestFailed | EngineDead | EngineReady | EngineStartFailed
)
#: Where the loop's messages go: called once per message.
Emit = Callable[[EngineMessage], None]


def portable_error(error: BaseException) -> BaseException:
    """``error`` when it survives pickling, else a ``RuntimeError`` naming its type and text."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any pickling failure
        return RuntimeError(f"{type(error).__name__}: {error}")
