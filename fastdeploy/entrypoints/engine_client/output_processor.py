"""Engine outputs into cumulative request outputs, for the front ends (``LLM``, the server).

The engine already decided which requests ended and cut their text at stop strings (the
:class:`~fastdeploy.core.stop_checker.StopChecker` is the one owner of that decision); this
module only accumulates each request's tokens, text and logprobs, step after step, and exposes
what the last step added (for streaming).

Each step gives a request NEW output objects that later steps never change, so a consumer may keep
them: the server's streams do, and one that is a few steps behind still reads every step's delta.
Without copying the whole output every step: a request's cumulative ``token_ids`` and ``logprobs``
are one list that grows in place, and each step's :class:`CompletionOutput` holds it with its
length at that step; reading ``token_ids`` of an unfinished output copies that prefix once (the
streaming paths never read it: they use the deltas, and the finished output's full lists). The
text is kept the same way, as the list of each step's new text, joined when ``text`` is first
read: appending to one string every step copied it whole each time (quadratic in the output's
length, about 250 MB of copying for an 8,000-token answer).
"""

from __future__ import annotations

from dataclasses import dataclass

from fastdeploy.core.outputs import EngineOutput
from fastdeploy.core.sampling_params import SamplingParams

_FIELDS = (
    "index", "text", "token_ids", "logprobs", "finish_reason", "stop_reason", "delta_text",
    "delta_token_ids", "delta_logprobs",
)  # fmt: skip


class CompletionOutput:
    """One generated sequence. ``text``/``token_ids``/``logprobs`` are cumulative; ``delta_text``,
    ``delta_token_ids`` and ``delta_logprobs`` are what this update added (for streaming).

    Built like a dataclass of the fields in that order (``CompletionOutput(0, "text", [ids])``);
    ``token_ids`` and ``logprobs`` may also be a prefix of a list that keeps growing, see
    :meth:`prefix_of`."""

    __slots__ = (
        "index", "finish_reason", "stop_reason", "delta_text", "delta_token_ids",
        "delta_logprobs", "_token_ids", "_num_token_ids", "_logprobs", "_num_logprobs", "_shared",
        "_text", "_text_parts", "_num_text_parts",
    )  # fmt: skip

    def __init__(
        self,
        index: int,
        text: str = "",
        token_ids: list[int] | None = None,
        logprobs: list[dict] | None = None,
        finish_reason: str | None = None,
        stop_reason: str | int | None = None,
        delta_text: str = "",
        delta_token_ids: list[int] | None = None,
        delta_logprobs: list[dict] | None = None,
    ) -> None:
        self.index = index
        self.text = text
        self.token_ids = [] if token_ids is None else token_ids
        self.logprobs = logprobs
        self.finish_reason = finish_reason
        self.stop_reason = stop_reason
        self.delta_text = delta_text
        self.delta_token_ids = [] if delta_token_ids is None else delta_token_ids
        self.delta_logprobs = delta_logprobs

    @classmethod
    def prefix_of(
        cls,
        token_ids: list[int],
        logprobs: list[dict] | None,
        shared: bool,
        text_parts: list[str],
        finish_reason: str | None,
        stop_reason: str | int | None,
        delta_text: str,
        delta_token_ids: list[int],
        delta_logprobs: list[dict] | None,
    ) -> CompletionOutput:
        """Output 0 of a request, whose ``token_ids`` and ``logprobs`` are the first ``len()``
        items, as they are now, of lists the caller goes on extending in place when ``shared``
        (they are copied on first read); with ``shared`` False the lists are the output's own.
        ``text`` is the join of the first ``len(text_parts)`` strings of ``text_parts`` (a list
        the caller may go on extending), joined on first read. The other arguments are the
        fields of the same names."""
        out = cls.__new__(cls)
        out.index = 0
        out._text = None
        out._text_parts = text_parts
        out._num_text_parts = len(text_parts)
        out.finish_reason = finish_reason
        out.stop_reason = stop_reason
        out.delta_text = delta_text
        out.delta_token_ids = delta_token_ids
        out.delta_logprobs = delta_logprobs
        out._token_ids = token_ids
        out._num_token_ids = len(token_ids)
        out._logprobs = logprobs
        out._num_logprobs = len(logprobs) if logprobs is not None else 0
        out._shared = shared
        return out

    @property
    def text(self) -> str:
        """The output text so far."""
        if self._text is None:
            self._text = "".join(self._text_parts[: self._num_text_parts])
            self._text_parts = None
        return self._text

    @text.setter
    def text(self, value: str) -> None:
        self._text, self._text_parts = value, None

    @property
    def token_ids(self) -> list[int]:
        """Every output token id so far."""
        if self._shared:
            self._freeze()
        return self._token_ids

    @token_ids.setter
    def token_ids(self, value: list[int]) -> None:
        self._token_ids, self._num_token_ids = value, len(value)
        self._shared = False

    @property
    def num_token_ids(self) -> int:
        """``len(token_ids)``, without copying a shared prefix."""
        return self._num_token_ids

    @property
    def logprobs(self) -> list[dict] | None:
        """Every output token's logprobs entry so far, or None without logprobs."""
        if self._shared:
            self._freeze()
        return self._logprobs

    @logprobs.setter
    def logprobs(self, value: list[dict] | None) -> None:
        if getattr(self, "_shared", False):
            self._freeze()
        self._logprobs = value
        self._num_logprobs = len(value) if value is not None else 0

    def _freeze(self) -> None:
        """Copy the shared prefixes into lists of this output's own."""
        self._token_ids = self._token_ids[: self._num_token_ids]
        if self._logprobs is not None:
            self._logprobs = self._logprobs[: self._num_logprobs]
        self._shared = False

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CompletionOutput):
            return NotImplemented
        return all(getattr(self, f) == getattr(other, f) for f in _FIELDS)

    def __repr__(self) -> str:
        inner = ", ".join(f"{f}={getattr(self, f)!r}" for f in _FIELDS)
        return f"CompletionOutput({inner})"


@dataclass
class RequestOutput:
    """The state of one request after a step. ``kv_transfer_params`` is set on the finished
    output of a PD prefill leg (where its KV waits for the decode node).

    ``prompt_logprobs``: None unless ``SamplingParams.prompt_logprobs`` was asked; then, from
    the request's first output on, ``len(prompt_token_ids)`` entries: ``None`` for position 0,
    then per prompt token ``{"token_id", "logprob", "rank", "top_logprobs": [(id, lp)]}`` (the
    log-probability of that token given the ones before it, float32 from the raw distribution)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    kv_transfer_params: dict | None = None
    prompt_logprobs: list[dict | None] | None = None


class _Accumulated:
    """What a request has produced so far; ``token_ids`` and ``logprobs`` only ever grow."""

    __slots__ = (
        "prompt", "prompt_token_ids", "text_parts", "token_ids", "logprobs", "kv_params",
        "prompt_logprobs",
    )  # fmt: skip

    def __init__(self, prompt: str | None, prompt_token_ids: list[int]) -> None:
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.text_parts: list[str] = []  # each step's new text (CompletionOutput joins them)
        self.token_ids: list[int] = []
        self.logprobs: list[dict] | None = None
        self.kv_params: dict | None = None
        self.prompt_logprobs: list[dict | None] | None = None


class OutputProcessor:
    """Turns :class:`EngineOutput` deltas into cumulative :class:`RequestOutput` objects (the
    text itself comes from the engine), new ones each step (module docstring)."""

    def __init__(self) -> None:
        self._requests: dict[str, _Accumulated] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
    ) -> None:
        """Start tracking a request (call right after ``engine.add_request``)."""
        self._requests[request_id] = _Accumulated(prompt, list(prompt_token_ids))

    def abort_request(self, request_id: str) -> None:
        """Stop tracking a request."""
        self._requests.pop(request_id, None)

    def process(self, outputs: list[EngineOutput]) -> list[RequestOutput]:
        """Apply one step's outputs; returns the requests' new outputs (finished requests are
        dropped from tracking after this call). Outputs of untracked requests are ignored."""
        results = []
        requests = self._requests
        for eo in outputs:
            acc = requests.get(eo.request_id)
            if acc is None:
                continue
            acc.token_ids.extend(eo.new_token_ids)
            if eo.new_logprobs is not None:
                if acc.logprobs is None:
                    acc.logprobs = []
                acc.logprobs.extend(eo.new_logprobs)
            if eo.new_text:
                acc.text_parts.append(eo.new_text)
            if eo.kv_transfer_params is not None:
                acc.kv_params = eo.kv_transfer_params
            if eo.prompt_logprobs is not None:
                acc.prompt_logprobs = eo.prompt_logprobs
            comp = CompletionOutput.prefix_of(
                acc.token_ids,
                acc.logprobs,
                not eo.finished,  # a finished request's lists never grow again
                acc.text_parts,
                eo.finish_reason,
                eo.stop_reason,
                eo.new_text,
                eo.new_token_ids,
                eo.new_logprobs,
            )
            results.append(
                RequestOutput(
                    eo.request_id,
                    acc.prompt,
                    acc.prompt_token_ids,
                    [comp],
                    eo.finished,
                    eo.num_cached_tokens,
                    acc.kv_params,
                    acc.prompt_logprobs,
                )
            )
            if eo.finished:
                del requests[eo.request_id]
        return results
