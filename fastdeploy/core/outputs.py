"""What one engine step produced for one request (engine -> front ends)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineOutput:
    """What one step produced for one request.

    ``new_logprobs`` holds, per new token, ``{"token_id", "logprob", "top_logprobs": [(id, lp)]}``
    when the request asked for logprobs. ``finish_reason`` is ``stop``, ``length``, ``abort`` or
    ``None``.
    """

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[dict] | None
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
