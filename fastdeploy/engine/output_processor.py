"""Engine outputs into cumulative request outputs, for the front ends (``LLM``, the server).

The engine already decided which requests ended and cut their text at stop strings (the
:class:`~fastdeploy.engine.stop_checker.StopChecker` is the one owner of that decision); this
module only accumulates each request's tokens, text and logprobs, step after step, and exposes
what the last step added (for streaming).
"""

from __future__ import annotations

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
    """The state of one request after a step. ``kv_transfer_params`` is set on the finished
    output of a PD prefill leg (where its KV waits for the decode node)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    kv_transfer_params: dict | None = None


class OutputProcessor:
    """Turns :class:`EngineOutput` deltas into cumulative :class:`RequestOutput` objects (the
    text itself comes from the engine)."""

    def __init__(self) -> None:
        self._outputs: dict[str, RequestOutput] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
    ) -> None:
        """Start tracking a request (call right after ``engine.add_request``)."""
        self._outputs[request_id] = RequestOutput(
            request_id, prompt, list(prompt_token_ids), [CompletionOutput(index=0)]
        )

    def abort_request(self, request_id: str) -> None:
        """Stop tracking a request."""
        self._outputs.pop(request_id, None)

    def process(self, outputs: list[EngineOutput]) -> list[RequestOutput]:
        """Apply one step's outputs; returns the updated requests (finished ones are dropped from
        tracking after this call). Outputs of untracked requests are ignored."""
        results = []
        for eo in outputs:
            out = self._outputs.get(eo.request_id)
            if out is None:
                continue
            comp = out.outputs[0]
            comp.token_ids.extend(eo.new_token_ids)
            comp.delta_token_ids = list(eo.new_token_ids)
            comp.delta_logprobs = eo.new_logprobs
            if eo.new_logprobs is not None:
                comp.logprobs = (comp.logprobs or []) + eo.new_logprobs
            comp.text += eo.new_text
            comp.delta_text = eo.new_text
            comp.finish_reason = eo.finish_reason
            comp.stop_reason = eo.stop_reason
            out.num_cached_tokens = eo.num_cached_tokens
            if eo.kv_transfer_params is not None:
                out.kv_transfer_params = eo.kv_transfer_params
            out.finished = eo.finished
            results.append(out)
            if eo.finished:
                del self._outputs[eo.request_id]
        return results
