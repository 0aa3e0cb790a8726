"""A request as the scheduler sees it: token ids and a few integer lengths."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from fastdeploy.core.sampling_params import SamplingParams


class InvalidPromptError(ValueError):
    """A prompt the model cannot take: empty, or holding a token id outside the vocabulary. The
    server answers it with a 400 on the prompt's field (``prompt`` or ``messages``)."""


class PromptTooLongError(ValueError):
    """A prompt with no room for one output token within ``max_model_len`` (an OpenAI
    ``context_length_exceeded`` error). ``num_prompt_tokens`` and ``max_model_len`` are the two
    numbers the message names."""

    def __init__(self, num_prompt_tokens: int, max_model_len: int, note: str | None = None):
        why = note or "prompt tokens must be fewer than max_model_len to leave room for output"
        super().__init__(
            f"the prompt has {num_prompt_tokens} tokens, but max_model_len is {max_model_len} "
            f"({why})"
        )
        self.num_prompt_tokens = num_prompt_tokens
        self.max_model_len = max_model_len


def check_prompt_length(
    num_prompt_tokens: int, max_model_len: int, note: str | None = None
) -> None:
    """The one prompt-length rule: at least one token, and fewer than ``max_model_len`` so that
    there is room for one output token. Front ends (through :func:`check_prompt`) and the
    scheduler both call it. ``note`` says where ``max_model_len`` comes from when it is not the
    configured value (the engine lowers it to what the KV cache holds).

    Raises:
        InvalidPromptError: ``num_prompt_tokens == 0``.
        PromptTooLongError: ``num_prompt_tokens >= max_model_len`` (the message names both
            lengths, and ``note``).
    """
    if num_prompt_tokens == 0:
        raise InvalidPromptError("the prompt is empty (0 tokens); allowed: at least 1 token")
    if num_prompt_tokens >= max_model_len:
        raise PromptTooLongError(num_prompt_tokens, max_model_len, note)


def check_prompt(
    prompt_token_ids: list[int], max_model_len: int, vocab_size: int, note: str | None = None
) -> None:
    """Admission check of a prompt's token ids: :func:`check_prompt_length`, then the vocabulary.

    Raises:
        InvalidPromptError: an empty prompt, or a token id outside ``0..vocab_size-1`` (the
            message names the first such id, its position and the allowed range).
        PromptTooLongError: a prompt of ``max_model_len`` tokens or more (no room for one output
            token; the message names both lengths).
    """
    check_prompt_length(len(prompt_token_ids), max_model_len, note)
    for i, t in enumerate(prompt_token_ids):
        if not isinstance(t, int) or not 0 <= t < vocab_size:
            raise InvalidPromptError(
                f"prompt token id {t!r} at position {i} is outside the vocabulary; allowed: "
                f"token ids in 0..{vocab_size - 1}"
            )


def check_sampling(params: SamplingParams, vocab_size: int, has_tokenizer: bool) -> None:
    """Admission check of the sampling parameters against the model: token ids in
    ``stop_token_ids`` and ``logit_bias`` inside the vocabulary, and stop strings only where a
    tokenizer turns tokens into text.

    Raises:
        ValueError: naming the field, the value and what is allowed (``n`` other than 1: one
            engine request is one sequence; the front end fans ``n`` out with
            :func:`fastdeploy.core.parallel_sampling.choice_params`).
    """
    if params.n != 1:
        raise ValueError(
            f"n={params.n!r} is invalid for one engine request; allowed: 1 (a front end such as "
            "LLM.generate fans n out into n requests: fastdeploy.core.parallel_sampling)"
        )
    for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias)):
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise ValueError(
                f"{name}={bad[0]!r} is invalid; allowed: token ids in [0, {vocab_size})"
            )
    if params.stop and not has_tokenizer:
        raise ValueError(
            f"stop={params.stop!r} is invalid; allowed: no stop strings when the engine has no "
            "tokenizer (skip_tokenizer_init): use stop_token_ids"
        )


class RequestStatus(enum.Enum):
    """Lifecycle of a request. ``WAITING`` includes requests preempted by recompute.

    ``WAITING_FOR_REMOTE_KV``: a decode-leg request of a PD deployment that holds its KV blocks
    while its prompt's KV is pulled from the prefill node; it is never scheduled in that state.

    ``WAITING_FOR_SWAP_IN``: a request admitted with prefix hits in the host KV tier
    (``swap_in_mode=request``) that holds its KV blocks while those hits are copied back to the
    device; it is never scheduled in that state.
    """

    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    WAITING_FOR_SWAP_IN = "waiting_for_swap_in"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"  # eos, stop string or stop token
    FINISHED_LENGTH = "length"  # max_tokens or max_model_len
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        """True for the three finished states."""
        return self.value in ("stop", "length", "abort")


@dataclass(eq=False)
class Request:
    """One generation request.

    Lengths, all in tokens:
      * ``num_prompt_tokens``: ``len(prompt_token_ids)``;
      * ``num_tokens``: prompt plus generated tokens so far;
      * ``num_computed_tokens``: tokens whose KV is in the cache (including ``num_cached_tokens``);
      * ``num_cached_tokens``: prompt tokens found in the prefix cache (or the host tier) at
        admission, reset when the request is preempted and looked up again at re-admission;
      * ``first_num_cached_tokens``: ``num_cached_tokens`` of the first admission (None before
        it), what outputs and the usage report (as vLLM does): a re-admission after a
        preemption mostly finds the request's own freed blocks, which no other request computed;
      * ``num_output_placeholders``: tokens sampled by steps still in flight (overlap schedule),
        whose ids the host does not know yet; they count as scheduled, never as output.

    ``block_ids`` is the request's block table (KV block ids in order).

    Runtime state set by the engine, which survives preemption with the request:
    ``eos_token_ids`` (the model's eos ids) and ``detokenizer`` (its incremental detokenizer,
    an ``core.detokenizer.IncrementalDetokenizer`` or None without a tokenizer).

    Prompt log-probabilities (``sampling_params.prompt_logprobs``): ``prompt_logprobs`` holds
    the entries computed so far (``[None]`` for position 0, then one dict per prompt position, see
    :attr:`EngineOutput.prompt_logprobs`); ``num_prompt_logprob_rows`` counts the token rows
    ``0..n-1`` of launched steps whose logits gave them (row ``j`` scores prompt token ``j + 1``).
    It survives preemption, so a re-prefill computes and emits no position twice.

    Prefill/decode disaggregation: ``remote_decode`` marks a prefill-leg request (its blocks are
    held for a decode node when it finishes); ``remote_prefill`` is, on a decode node, where the
    prompt's KV waits (a ``splitwise.protocol.RemotePrefill``), None once it was pulled or when
    the request is served locally.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    first_num_cached_tokens: int | None = None
    num_preemptions: int = 0
    block_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    first_token_time: float | None = None
    finish_time: float | None = None
    stop_reason: str | int | None = None
    eos_token_ids: frozenset[int] = frozenset()
    detokenizer: Any = field(default=None, repr=False)
    remote_decode: bool = False
    remote_prefill: Any = field(default=None, repr=False)
    num_output_placeholders: int = 0
    prompt_logprobs: list[dict | None] | None = field(default=None, repr=False)
    num_prompt_logprob_rows: int = 0

    def __post_init__(self) -> None:
        if self.sampling_params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]  # position 0 has no logprob (nothing precedes it)

    @property
    def num_prompt_logprob_rows_left(self) -> int:
        """Token rows whose logits still owe prompt log-probabilities: 0 unless
        ``prompt_logprobs`` was asked, else rows ``num_prompt_logprob_rows .. P-2``."""
        if self.sampling_params.prompt_logprobs is None:
            return 0
        return max(0, self.num_prompt_tokens - 1 - self.num_prompt_logprob_rows)

    @property
    def max_prefix_hit_tokens(self) -> int:
        """The most leading tokens a prefix-cache hit (device or host tier) may cover: all but
        the last token (a logit to sample), and for a request with ``prompt_logprobs`` only rows
        whose log-probabilities are already computed (a cached token has no logit; vLLM's rule:
        such a request does not read the cache on its first admission)."""
        limit = self.num_tokens - 1
        if self.num_prompt_logprob_rows_left:
            limit = min(limit, self.num_prompt_logprob_rows)
        return limit

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def reported_cached_tokens(self) -> int:
        """Prompt tokens reported as cached: the first admission's count
        (``first_num_cached_tokens``), or the current one before any admission."""
        first = self.first_num_cached_tokens
        return self.num_cached_tokens if first is None else first

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        """Known tokens plus those sampled by steps in flight: what the scheduler computes up
        to (equal to ``num_tokens`` without the overlap schedule)."""
        return self.num_tokens + self.num_output_placeholders

    def reaches_length_limit(self, max_model_len: int, num_pending: int = 0) -> bool:
        """The length rule (``StopChecker`` rules 5 and 6): the request ends with ``length``
        once it holds ``max_model_len`` tokens or ``max_tokens`` output tokens, counting
        ``num_pending`` tokens not appended yet. The scheduler asks it with the placeholders of
        an overlapped step, so a request that will end by length is not scheduled again."""
        num_output = len(self.output_token_ids) + num_pending
        if len(self.prompt_token_ids) + num_output >= max_model_len:
            return True
        max_tokens = self.sampling_params.max_tokens
        return max_tokens is not None and num_output >= max_tokens

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def min_tokens_stop_ids(self) -> frozenset[int]:
        """Token ids masked out of sampling while fewer than ``min_tokens`` tokens are out: eos
        (unless ``ignore_eos``) and every ``stop_token_ids`` entry. Empty when ``min_tokens`` is
        0."""
        params = self.sampling_params
        if params.min_tokens == 0:
            return frozenset()
        eos = frozenset() if params.ignore_eos else self.eos_token_ids
        return eos | frozenset(params.stop_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        """OpenAI finish reason: ``stop``, ``length``, ``abort`` or ``None`` while running."""
        return self.status.value if self.status.finished else None
