"""Grammars of structured-output requests in the engine process: compile (cached, on a thread),
one xgrammar ``GrammarMatcher`` per request, the token bitmask of a step, the accepted tokens.

Library: xgrammar (PyPI ``xgrammar``; the same one vLLM v0.11 defaults to, see its
``vllm/v1/structured_output/backend_xgrammar.py``). The flow follows vLLM v1's (the engine owns
the matchers and ships a ``[rows, ceil(V / 32)]`` int32 bitmask with the step; the runner applies
it to the logits before sampling), in code of its own:

* compile: :meth:`StructuredOutputs.add` submits ``(kind, spec)`` to a compile thread when the
  request arrives; the request waits outside the scheduler until the compile has ended (the
  engine's ``compiling``; a 400 after ``FD_STRUCTURED_OUTPUT_COMPILE_TIMEOUT_S``), so the step
  loop never waits for a compile and other requests run meanwhile. Compiled grammars are
  cached by ``(kind, spec)`` (a dict of futures, so concurrent requests with one schema compile
  it once; xgrammar's compiler caches too).
  Why compile here and ship specs, not compiled grammars: a ``CompiledGrammar`` can be
  serialized (``serialize_json``) but carries its per-token mask cache (megabytes for a 49k
  vocabulary), the server would need the tokenizer info, and the cache here already makes a
  repeated schema free. The server parses the spec tokenizer-free to refuse bad ones
  (:func:`fastdeploy.core.structured_output.check_grammar`).
* bitmask: :meth:`bitmask` fills one row per sampling row of the step (all ones for a row
  without a grammar) from the matchers, which must have accepted every earlier token: under the
  overlap schedule the runner asks for it after queueing the step's forward, once the step in
  flight's tokens were accepted (:mod:`fastdeploy.engine.step_pipeline`). A step without
  grammar rows gets None and costs nothing. The rows go into one host buffer reused by every
  step (the runner copies it out before the next step's mask is built); from
  :data:`BATCH_FILL_MIN_ROWS` rows on they are filled by xgrammar's ``BatchGrammarMatcher`` on
  up to :data:`FILL_THREADS` threads.
* accept: :meth:`accept` after the host reads a token (or :meth:`accept_early`, under the
  overlap schedule, just before the next grammar step's mask); a matcher that terminates (its
  grammar ended and accepted a stop token) ends the request with ``stop``.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future
from typing import Any

import torch

from fastdeploy.core.request import Request
from fastdeploy.core.scheduler_output import SchedulerOutput
from fastdeploy.core.structured_output import JSON_OBJECT_SCHEMA, check_grammar

logger = logging.getLogger(__name__)

#: Grammar rows from which a step's mask is filled by several threads (fewer: a loop, which
#: costs about 10 us per row on the 2-core CI host, less than the threads' hand-off).
BATCH_FILL_MIN_ROWS = 8
#: Grammar compiles that run at once.
COMPILE_THREADS = 2
#: Threads of that batch fill (xgrammar's ``BatchGrammarMatcher``), at most the host's cores.
FILL_THREADS = max(1, min(8, os.cpu_count() or 1))


class StructuredOutputs:
    """Owner of the compiled grammars and per-request matchers (see the module docstring).

    Args:
        tokenizer: the engine's Hugging Face tokenizer (xgrammar reads its vocabulary).
        vocab_size: the model's vocabulary (logits width), >= the tokenizer's.

    Raises:
        ValueError: (from :meth:`add`) a request with structured outputs and no tokenizer, or a
            spec that does not parse.
    """

    def __init__(self, tokenizer: Any | None, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._compiler = None
        #: Called (from the compile thread) when a compile ends: the engine loop's wake-up.
        self.on_compiled: Any = None
        self._compiler_lock = threading.Lock()
        #: Compiles running at once (one slow compile, which cannot be stopped, leaves one for
        #: the others); each runs on a daemon thread of its own (:meth:`_submit`).
        self._slots = threading.BoundedSemaphore(COMPILE_THREADS)
        self._closed = False
        self._compiled: dict[tuple[str, str], Future] = {}
        self._pending: dict[str, Future] = {}
        self._matchers: dict[str, Any] = {}
        self._early: dict[str, int] = {}  # tokens accepted before their step finished
        self._rejected: set[str] = set()
        self._host_mask: torch.Tensor | None = None  # int32 [rows so far, ceil(V / 32)]
        self._batch_fill: Any = None
        #: Steps that carried a bitmask, and grammar rows filled (metrics for tests and benches).
        self.num_masked_steps = 0
        self.num_masked_rows = 0

    def _compile(self, kind: str, spec: str) -> Any:
        import xgrammar as xgr

        with self._compiler_lock:  # COMPILE_THREADS threads, one compiler
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=2)
        c = self._compiler
        if kind == "json":
            return c.compile_json_schema(spec, any_whitespace=False, strict_mode=True)
        if kind == "json_object":
            return c.compile_json_schema(
                JSON_OBJECT_SCHEMA, any_whitespace=False, strict_mode=False
            )
        if kind == "regex":
            return c.compile_regex(spec)
        return c.compile_grammar(spec)

    def add(self, request: Request) -> None:
        """Start compiling ``request``'s grammar (cached); nothing for a request without one."""
        so = request.sampling_params.structured_outputs
        if so is None:
            return
        if self.tokenizer is None:
            raise ValueError(
                "structured_outputs is invalid without a tokenizer (skip_tokenizer_init); "
                "allowed: null"
            )
        key = so.key()
        check_grammar(*key)  # milliseconds; refuses what would fail to compile (offline API)
        future = self._compiled.get(key)
        if future is None:
            future = self._compiled[key] = self._submit(*key)
        self._pending[request.request_id] = future
        if not future.done() and self.on_compiled is not None:
            wake = self.on_compiled
            future.add_done_callback(lambda _: wake())

    def compile_state(self, request_id: str) -> bool | BaseException:
        """Whether ``request_id``'s grammar has compiled: True (or no grammar, or its matcher
        exists), False while compiling, or the exception its compile raised."""
        future = self._pending.get(request_id)
        if future is None or not future.done():
            return future is None
        error = future.exception()
        return True if error is None else error

    @property
    def alive(self) -> bool:
        """Whether any request with a grammar is compiling or decoding (steps without one
        skip every per-row walk)."""
        return bool(self._pending or self._matchers)

    def has_grammar(self, request_id: str) -> bool:
        return request_id in self._pending or request_id in self._matchers

    def _matcher(self, request_id: str) -> Any | None:
        matcher = self._matchers.get(request_id)
        if matcher is None and request_id in self._pending:
            import xgrammar as xgr

            compiled = self._pending.pop(request_id).result()
            matcher = self._matchers[request_id] = xgr.GrammarMatcher(compiled)
        return matcher

    def bitmask(self, sched: SchedulerOutput) -> torch.Tensor | None:
        """int32 ``[num_sampling_rows, ceil(vocab_size / 32)]`` on the host, bit ``t`` of a row
        set when token ``t`` is allowed (xgrammar's layout), rows in the order of the step's
        sampling requests; None when no sampling request of ``sched`` has a grammar."""
        if not self.alive:  # no grammar request alive: no row walk
            return None
        rows = [s.request.request_id for s in sched.scheduled if s.samples]
        grammar_rows = [i for i, rid in enumerate(rows) if self.has_grammar(rid)]
        if not grammar_rows:
            return None
        mask = self._rows(len(rows))
        live, indices = [], []
        for i in grammar_rows:
            matcher = self._matcher(rows[i])
            # A matcher that ended in the step in flight (overlap schedule): its row's token is
            # dropped, so its row stays all ones and is not counted.
            if not matcher.is_terminated():
                live.append(matcher)
                indices.append(i)
        if len(live) >= BATCH_FILL_MIN_ROWS:
            if self._batch_fill is None:
                import xgrammar as xgr

                self._batch_fill = xgr.BatchGrammarMatcher(max_threads=FILL_THREADS)
            self._batch_fill.batch_fill_next_token_bitmask(live, mask, indices)
        else:
            for matcher, i in zip(live, indices):
                matcher.fill_next_token_bitmask(mask, i)
        self.num_masked_rows += len(live)
        self.num_masked_steps += 1
        return mask

    def _rows(self, n: int) -> torch.Tensor:
        """The first ``n`` rows of the reused host mask buffer, set to all ones (every token
        allowed); the buffer grows to the largest step seen.

        Always allocated and written in inference mode: the deferred mask is built inside the
        runner's inference mode and an immediate one outside it, and an inference tensor may
        not be written in place outside inference mode."""
        words = (self.vocab_size + 31) // 32
        with torch.inference_mode():
            if self._host_mask is None or self._host_mask.shape[0] < n:
                self._host_mask = torch.empty((n, words), dtype=torch.int32)
            mask = self._host_mask[:n]
            mask.fill_(-1)
        return mask

    def accept_early(self, samplers: list[Request], token_ids: dict[str, int]) -> None:
        """Feed the tokens of a step not finished yet to the matchers of its grammar requests
        (overlap schedule: before the next step's mask); :meth:`accept` then skips them."""
        for request in samplers:
            rid = request.request_id
            if rid in token_ids and self.has_grammar(rid):
                self._advance(rid, token_ids[rid])
                self._early[rid] = self._early.get(rid, 0) + 1

    def _advance(self, rid: str, token_id: int) -> None:
        matcher = self._matcher(rid)
        if not matcher.is_terminated() and not matcher.accept_token(token_id):
            # Only a token the mask allowed is sampled; a rejected one means the mask and the
            # matcher disagree (e.g. min_tokens masked the only allowed stop token): end it.
            logger.warning("request %s: grammar rejected token %d; finishing it", rid, token_id)
            self._rejected.add(rid)

    def accept(self, request: Request, token_id: int) -> bool:
        """Advance ``request``'s matcher by its new token (unless :meth:`accept_early` did);
        True when the grammar has ended (the request finishes with ``stop``). False for a request
        without a grammar."""
        rid = request.request_id
        if not self.has_grammar(rid):
            return False
        early = self._early.get(rid, 0)
        if early:
            self._early[rid] = early - 1
        else:
            self._advance(rid, token_id)
        return rid in self._rejected or self._matchers[rid].is_terminated()

    def free(self, request_id: str) -> None:
        """Drop a finished or aborted request's matcher (its compiled grammar stays cached)."""
        self._pending.pop(request_id, None)
        self._matchers.pop(request_id, None)
        self._early.pop(request_id, None)
        self._rejected.discard(request_id)

    def _submit(self, kind: str, spec: str) -> Future:
        """Compile on a daemon thread once one of :data:`COMPILE_THREADS` slots is free. Not a
        ``ThreadPoolExecutor``: its threads are joined at interpreter exit, so a compile of
        minutes would hold the engine process's shutdown that long."""
        future: Future = Future()

        def run() -> None:
            with self._slots:
                if self._closed or not future.set_running_or_notify_cancel():
                    return
                try:
                    future.set_result(self._compile(kind, spec))
                except BaseException as e:  # noqa: BLE001 - handed to the waiting request
                    future.set_exception(e)

        threading.Thread(target=run, name="fd-grammar", daemon=True).start()
        return future

    def shutdown(self) -> None:
        """Start no more compiles (one running finishes on its daemon thread, or dies with the
        process); the queued ones are cancelled."""
        self._closed = True
        for future in self._compiled.values():
            future.cancel()
