"""The engine loop on a thread of the API server process (``--disable-frontend-multiprocessing``,
and any engine object handed to :class:`~.async_engine.AsyncLLMEngine` directly, such as the
tests' stand-ins).

One of the two launchers of the engine on the server's side (with :mod:`.process_client`): it
may import the engine's entry point, :class:`~fastdeploy.engine.engine_loop.EngineLoop`.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from typing import TYPE_CHECKING, Any, Protocol

from fastdeploy.core.messages import AdmissionCheck, Command, Emit, EngineMessage
from fastdeploy.core.sampling_params import SamplingParams
from fastdeploy.engine.engine_loop import EngineLoop, SteppableEngine

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class LocalEngine(SteppableEngine, Protocol):
    """An engine that runs in this process (``LLMEngine``, or a test's stand-in): what
    :class:`~fastdeploy.engine.engine_loop.EngineLoop` drives, and what the server reads of
    it. Optional, read with ``getattr``: ``max_model_len_note``, ``config``, ``plan``
    (each with ``to_dict()``)."""

    tokenizer: PreTrainedTokenizerBase | None
    max_model_len: int
    vocab_size: int

    def check_request(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        kv_transfer_params: dict | None = None,
    ) -> Any:
        """The admission check (``ValueError`` naming what is wrong)."""

    def admission(self) -> AdmissionCheck:
        """What requests are checked against (a decode node's trusted prefill nodes among it)."""

    def shutdown(self) -> None:
        """Release the model and the KV cache."""


class ThreadCore:
    """The engine loop on a daemon thread of this process, for
    :class:`~.async_engine.AsyncLLMEngine`.

    Both threads share one GIL, so what the server's asyncio thread spends per step is taken
    from the engine's host time: with the small SmolLM2-135M model on an H200, whose step is
    host-bound, 64 streams were served at 11,141 output tok/s this way and 26,471 with the engine
    in its own process, against 37,998 offline (README, Benchmarks). The server's default is
    therefore :class:`~.process_client.EngineCoreProcess`.

    Args:
        engine: what :class:`~fastdeploy.engine.engine_loop.EngineLoop` drives; its attributes
            ``tokenizer``, ``max_model_len``, ``vocab_size`` (``max_model_len_note``, ``config``
            and ``plan`` when it has them) and ``check_request`` are read by the server.
    """

    def __init__(self, engine: LocalEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len: int = engine.max_model_len
        self.max_model_len_note: str | None = getattr(engine, "max_model_len_note", None)
        self.vocab_size: int = engine.vocab_size
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def check_request(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        kv_transfer_params: dict | None = None,
    ) -> Any:
        """The engine's own ``check_request`` (pure, so safe off the engine thread)."""
        if kv_transfer_params is None:
            return self.engine.check_request(prompt_token_ids, sampling_params)
        return self.engine.check_request(prompt_token_ids, sampling_params, kv_transfer_params)

    @property
    def splitwise_role(self) -> str:
        """The engine's PD role: ``mixed``, ``prefill`` or ``decode`` (``mixed`` for a stand-in
        without a config)."""
        config = getattr(self.engine, "config", None)
        return config.parallel_config.splitwise_role if config is not None else "mixed"

    def release_refused_leg(self, params: object) -> bool:
        """A decode leg was refused before admission: free its prefill node's blocks now
        (``fastdeploy.splitwise.legs.release_refused_leg``, with the trusted prefill nodes of
        this node's admission). Returns whether an ABORT was started."""
        return self.engine.admission().release_refused_leg(params)

    def describe(self) -> dict:
        """``{"config": ..., "deployment_plan": ...}`` as dicts (empty for a stand-in without
        them)."""
        out = {}
        for key, name in (("config", "config"), ("deployment_plan", "plan")):
            value = getattr(self.engine, name, None)
            if value is not None:
                out[key] = value.to_dict()
        return out

    def start(self, emit: Emit, loop: asyncio.AbstractEventLoop) -> None:
        """Start the loop thread; each message becomes a call ``emit(message)`` on ``loop``'s
        thread (``call_soon_threadsafe``; dropped once that loop is closed)."""

        def post(message: EngineMessage) -> None:
            try:
                loop.call_soon_threadsafe(emit, message)
            except RuntimeError:  # the loop is closed
                pass

        engine_loop = EngineLoop(self.engine, self._commands, post)
        self._thread = threading.Thread(
            target=engine_loop.run, name="fastdeploy-engine", daemon=True
        )
        self._thread.start()

    def send(self, cmd: Command) -> None:
        """Queue a command for the loop (any thread)."""
        self._commands.put(cmd)

    @property
    def thread_id(self) -> int | None:
        """``threading`` ident of the loop thread (None before :meth:`start`)."""
        return None if self._thread is None else self._thread.ident

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def join(self, timeout_s: float) -> bool:
        """Wait for the loop to end after :class:`StopLoop`; True when it did."""
        if self._thread is not None:
            self._thread.join(timeout_s)
        return not self.is_alive()

    def close(self) -> None:
        """Release the engine (call after :meth:`join` returned True)."""
        self.engine.shutdown()

    def kill(self) -> None:
        """Nothing: a thread cannot be stopped inside a step, and releasing the model under it
        would be unsafe. It is a daemon, so it does not keep the process alive."""
