"""The one owner of the decision that a request has ended.

:meth:`StopChecker.check` runs once per new output token, on the engine's thread, right after
the scheduler appended the token; nothing else ends a request (aborts aside). Its rules, in
order (vLLM's ``StopChecker`` order, with stop strings ahead of the length limits):

1. ``min_tokens``: while the request has at most ``min_tokens`` output tokens, no stop of kind
   ``stop`` applies (eos and ``stop_token_ids`` are also masked out of sampling then, so they
   cannot come out; see :mod:`fastdeploy.model_executor.layers.logits_processor`);
2. eos (unless ``ignore_eos``): ``stop``; its text is not added;
3. a ``stop_token_ids`` entry: ``stop``, ``stop_reason`` is the id; its text is not added;
4. a stop string ending in this token's text: ``stop``, the text is cut where it starts,
   ``stop_reason`` is the string;
5. ``max_model_len`` reached: ``length``;
6. ``max_tokens`` reached: ``length``.

So a stop string found on the step that also reaches ``max_tokens`` ends the request with
``stop``, and the text never shows it.
"""

from __future__ import annotations

from typing import Any

from fastdeploy.core.detokenizer import IncrementalDetokenizer
from fastdeploy.core.request import Request, RequestStatus


def find_stop_string(text: str, num_new_chars: int, stops: list[str]) -> tuple[int, str] | None:
    """The earliest stop string of ``stops`` that ends in the last ``num_new_chars``
    characters of ``text``: ``(index where it starts, the string)``, or None.

    Only matches that end in the new characters count, so text searched at an earlier step (or
    text of the first ``min_tokens`` tokens) is never matched on its own again.
    """
    best = None
    for stop in stops:
        start = max(0, len(text) - num_new_chars - len(stop) + 1)
        i = text.find(stop, start)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, stop)
    return best


class StopChecker:
    """Decides, token by token, whether a request has ended, and keeps its output text.

    Args:
        max_model_len: most tokens (prompt + output) of one request.
        tokenizer: the engine's tokenizer, or None (``skip_tokenizer_init``: no text, no stop
            strings; the engine refuses them at admission).
    """

    def __init__(self, max_model_len: int, tokenizer: Any | None) -> None:
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer

    def start(self, request: Request) -> None:
        """Give a new request its detokenizer (none without a tokenizer)."""
        params = request.sampling_params
        if self.tokenizer is not None:
            hold = max((len(s) for s in params.stop), default=1) - 1
            request.detokenizer = IncrementalDetokenizer(
                self.tokenizer, params.skip_special_tokens, hold
            )

    def check(self, request: Request, token_id: int) -> RequestStatus | None:
        """Apply the rules of this module to ``token_id``, the request's newest output token
        (already appended to ``request.output_token_ids``); returns the finished status, or None
        while the request goes on. Sets ``request.stop_reason`` for a stop token id or string."""
        params = request.sampling_params
        num_output = len(request.output_token_ids)
        may_stop = num_output > params.min_tokens
        if may_stop and not params.ignore_eos and token_id in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if may_stop and token_id in params.stop_token_ids:
            request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        detok = request.detokenizer
        grown = detok.add(token_id) if detok is not None else 0
        if may_stop and grown and params.stop:
            hit = find_stop_string(detok.text, grown, params.stop)
            if hit is not None:
                detok.truncate(hit[0])
                request.stop_reason = hit[1]
                return RequestStatus.FINISHED_STOPPED
        if request.reaches_length_limit(self.max_model_len):
            return RequestStatus.FINISHED_LENGTH
        return None
