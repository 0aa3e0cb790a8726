"""Detokenisation and stop strings, off the engine loop.

Incremental detokenisation uses the ``tokenizers`` library's ``DecodeStream`` where the tokenizer
has a fast backend, else re-decodes the whole output each step. Stop strings are searched only in
the newly decoded tail; the text that could still be the start of a stop string is held back from
streaming deltas until it is known not to be one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from fastdeploy.core.outputs import EngineOutput
from fastdeploy.core.sampling_params import SamplingParams


@dataclass
class CompletionOutput:
    """One generated sequence. ``text``/``token_ids`` are cumulative; ``delta_text`` and
    ``delta_token_ids`` are what this update added (for streaming)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[dict] | None = None


@dataclass
class RequestOutput:
    """The state of one request after a step. ``needs_finish`` is set when a stop string was
    found: the engine must then finish the request (:func:`process_and_finish` does it)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    needs_finish: bool = False


class _Detokenizer:
    def __init__(self, tokenizer, params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.skip = params.skip_special_tokens
        self.stream = None
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            from tokenizers.decoders import DecodeStream

            self.backend = backend
            self.stream = DecodeStream(skip_special_tokens=self.skip)
        self.ids: list[int] = []
        self.text = ""

    def add(self, token_ids: list[int]) -> None:
        self.ids.extend(token_ids)
        if self.tokenizer is None:  # skip_tokenizer_init: token ids only
            return
        if self.stream is not None:
            for t in token_ids:
                piece = self.stream.step(self.backend, t)
                if piece:
                    self.text += piece
        else:
            text = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip)
            if not text.endswith("\ufffd"):
                self.text = text


class _State:
    def __init__(self, request_id, prompt, prompt_token_ids, params, tokenizer) -> None:
        self.output = RequestOutput(
            request_id, prompt, list(prompt_token_ids), [CompletionOutput(index=0)]
        )
        self.params = params
        self.detok = _Detokenizer(tokenizer, params)
        self.sent = 0  # characters of text already streamed
        self.hold = max((len(s) for s in params.stop), default=1) - 1


class OutputProcessor:
    """Turns :class:`EngineOutput` token deltas into :class:`RequestOutput` with text.

    Args:
        tokenizer: a ``transformers`` tokenizer.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _State] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
    ) -> None:
        """Start tracking a request (call right after ``engine.add_request``)."""
        self._states[request_id] = _State(
            request_id, prompt, prompt_token_ids, sampling_params, self.tokenizer
        )

    def abort_request(self, request_id: str) -> None:
        """Stop tracking a request."""
        self._states.pop(request_id, None)

    def process(self, outputs: list[EngineOutput]) -> list[RequestOutput]:
        """Apply one step's outputs; returns the updated requests (finished ones are dropped from
        tracking after this call)."""
        results = []
        for eo in outputs:
            state = self._states.get(eo.request_id)
            if state is None:
                continue
            results.append(self._apply(state, eo))
            if state.output.finished:
                del self._states[eo.request_id]
        return results

    def _apply(self, state: _State, eo: EngineOutput) -> RequestOutput:
        out = state.output
        comp = out.outputs[0]
        comp.token_ids.extend(eo.new_token_ids)
        comp.delta_token_ids = list(eo.new_token_ids)
        comp.delta_logprobs = eo.new_logprobs
        if eo.new_logprobs is not None:
            comp.logprobs = (comp.logprobs or []) + eo.new_logprobs
        out.num_cached_tokens = eo.num_cached_tokens
        before = len(state.detok.text)
        state.detok.add(eo.new_token_ids)
        text = state.detok.text
        finished, reason = eo.finished, eo.finish_reason
        if state.params.stop and not finished:
            start = max(0, before - state.hold)
            hits = [(text.find(s, start), s) for s in state.params.stop]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                idx, stop = min(hits)
                text = text[:idx]
                finished, reason = True, "stop"
                comp.stop_reason = stop
                out.needs_finish = True
        comp.text = text
        comp.finish_reason = reason
        out.finished = finished
        visible = len(text) if finished else max(state.sent, len(text) - state.hold)
        comp.delta_text = text[state.sent : visible]
        state.sent = visible
        return out


def process_and_finish(
    processor: OutputProcessor,
    outputs: list[EngineOutput],
    finish: Callable[[str, str], None],
) -> list[RequestOutput]:
    """Apply one step's outputs and finish in the engine each request a stop string ended.

    The one place where front ends (``LLM`` and ``AsyncLLMEngine``) turn engine outputs into
    :class:`RequestOutput` objects.

    Args:
        processor: an :class:`OutputProcessor` (anything with its ``process`` method).
        outputs: one step's outputs, as ``LLMEngine.step`` returns them.
        finish: called as ``finish(request_id, "stop")`` for each output whose ``needs_finish``
            is set, e.g. ``engine.finish_request`` or a function that queues that call for the
            engine's thread.

    Returns what ``processor.process(outputs)`` returns.

    Raises:
        Whatever ``processor.process`` raises (no request is finished then), and whatever
        ``finish`` raises.
    """
    results = processor.process(outputs)
    for out in results:
        if out.needs_finish:
            finish(out.request_id, "stop")
    return results
