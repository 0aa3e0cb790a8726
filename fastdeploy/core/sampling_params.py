"""Per-request sampling parameters (names follow FastDeploy / vLLM / the OpenAI API)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from fastdeploy.config import check, check_int, is_number, unknown_key_error
from fastdeploy.core.structured_output import StructuredOutputsParams

#: Most entries of ``logit_bias`` (OpenAI's API refuses more than 300).
MAX_LOGIT_BIAS_ENTRIES = 300
#: Range of one ``logit_bias`` value (OpenAI's).
LOGIT_BIAS_RANGE = (-100.0, 100.0)
#: Most top log-probabilities one request may ask for (``logprobs``).
MAX_LOGPROBS = 20
#: Range of ``frequency_penalty`` and ``presence_penalty`` (OpenAI's).
PENALTY_RANGE = (-2.0, 2.0)
#: The server's default caps on a request's stop conditions (``--max-stop-strings``,
#: ``--max-stop-chars``, ``--max-stop-token-ids``). Every step of a request checks each of its
#: stop strings against its new text, so their number and length are a cost per step: 10,000
#: stop strings made every step of their request 7x slower (issue 43).
DEFAULT_STOP_LIMITS = (64, 4096, 256)
#: The ceilings of the same caps: what the offline API enforces, and the most the flags allow.
MAX_STOP_LIMITS = (1024, 65536, 4096)


class StopLimitError(ValueError):
    """A request's stop conditions exceed a cap of :class:`StopLimits`: ``field`` (``stop`` or
    ``stop_token_ids``) is the one at fault; the message names it, its count or length, and the
    cap."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(message)
        self.field = field_name


@dataclass(frozen=True)
class StopLimits:
    """Caps on a request's stop conditions: the number of ``stop`` strings, their total length
    in characters, and the number of ``stop_token_ids``.

    ``flags``: :meth:`check`'s message names the server's flag of the cap (False for the
    offline API's ceilings, :data:`MAX_STOP_LIMITS`).

    Raises:
        ValueError: a cap that is not an integer in 1..its ceiling, naming it.
    """

    max_stop_strings: int = DEFAULT_STOP_LIMITS[0]
    max_stop_chars: int = DEFAULT_STOP_LIMITS[1]
    max_stop_token_ids: int = DEFAULT_STOP_LIMITS[2]
    flags: bool = True

    def __post_init__(self) -> None:
        for name, ceiling in zip(_STOP_CAPS, MAX_STOP_LIMITS):
            value = getattr(self, name)
            check(
                isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= ceiling,
                name,
                value,
                f"an integer in 1..{ceiling}",
            )

    def check(self, stop: list[str], stop_token_ids: list[int]) -> None:
        """Raise :class:`StopLimitError` when ``stop`` or ``stop_token_ids`` exceed a cap."""
        counts = (len(stop), sum(map(len, stop)), len(stop_token_ids))
        what = ("stop strings", "characters in all stop strings", "stop_token_ids")
        for name, value, count, words in zip(_STOP_CAPS, self._caps, counts, what):
            if count > value:
                source = f" (--{name.replace('_', '-')})" if self.flags else ""
                field_name = "stop_token_ids" if name == "max_stop_token_ids" else "stop"
                raise StopLimitError(
                    field_name,
                    f"{field_name} has {count} {words}, more than the cap of {value}{source}; "
                    f"allowed: at most {value} {words}",
                )

    @property
    def _caps(self) -> tuple[int, int, int]:
        return (self.max_stop_strings, self.max_stop_chars, self.max_stop_token_ids)


_STOP_CAPS = ("max_stop_strings", "max_stop_chars", "max_stop_token_ids")
#: The offline API's caps (the ceilings; a server applies its own, lower ones first).
OFFLINE_STOP_LIMITS = StopLimits(*MAX_STOP_LIMITS, flags=False)


def _finite_in(value: object, lo: float, hi: float) -> bool:
    return is_number(value) and math.isfinite(value) and lo <= value <= hi


@dataclass
class SamplingParams:
    """How to pick tokens for one request.

    ``temperature=0`` is greedy. ``top_k=0`` (or -1) disables top-k; ``top_p=1`` disables top-p.
    ``seed`` makes a sampled request reproducible whatever it is batched with, and through a
    preemption. ``logprobs=N`` returns the log-probability of the chosen token and of the top N
    tokens at each step (N <= 20), from the model's raw distribution (before temperature, penalties,
    ``logit_bias`` and the ``min_tokens`` mask). ``prompt_logprobs=N`` (N <= 20, vLLM's field)
    returns, for every prompt position ``i >= 1``, the log-probability of prompt token ``i`` given
    the tokens before it and the top N alternatives (position 0 has none), from the same raw
    float32 distribution; see :attr:`RequestOutput.prompt_logprobs`. Prefix-cache rule (vLLM's):
    a request with ``prompt_logprobs`` never READS the prefix cache or the host KV tier (a cached
    prefix has no logits, so its whole prompt is computed and ``num_cached_tokens`` is 0); its
    full blocks are still cached for others. A PD (splitwise) role or tensor parallelism refuses
    it. ``stop`` strings end generation and are cut from
    the text; ``stop_token_ids`` end it too (at most 1,024 stop strings of 65,536 characters in
    all and 4,096 stop token ids: :data:`MAX_STOP_LIMITS`; a server's caps are lower,
    :class:`StopLimits`). ``ignore_eos`` keeps generating past eos
    (benchmarks).

    ``min_tokens``: the first ``min_tokens`` output tokens never end the request: eos and every
    ``stop_token_ids`` entry are masked out of sampling for them, and a stop string must end in
    the text of a later token. ``max_tokens`` ends it with ``length`` (so does
    ``max_model_len``); a stop string found on that same last step wins (``stop``).

    Logits processing, applied to every row (greedy ones included) before temperature, top-k and
    top-p, in this order (as vLLM does): the ``min_tokens`` mask and ``logit_bias``, then the
    penalties:

    * ``logit_bias``: ``{token_id: bias}``, bias in [-100, 100], added to the logit (OpenAI), at
      most 300 entries;
    * ``repetition_penalty`` > 0 (1 disables): a token seen in the prompt or the output has its
      logit divided by it when positive and multiplied by it when not (vLLM's definition, from
      Keskar et al. 2019, "CTRL");
    * ``frequency_penalty`` in [-2, 2]: subtracted once per time the token appeared in the output;
      ``presence_penalty`` in [-2, 2]: subtracted once if it appeared at all (OpenAI's definition).

    ``n`` (an integer >= 1): the number of outputs for each prompt (vLLM's field). The offline
    ``LLM`` returns them as ``RequestOutput.outputs[0..n-1]``; each is its own engine request
    (:mod:`fastdeploy.core.parallel_sampling`: the prompt is prefilled once, choice ``j`` samples
    with ``seed + j``); the engine itself takes ``n=1`` only.

    ``structured_outputs`` (vLLM's field, :class:`StructuredOutputsParams`): the output must match
    a JSON schema, JSON, a regex, a choice or a grammar. Tokens the grammar does not allow are
    masked out of every row's logits before the logits processing; when the grammar ends (its
    end is reached with a stop token), the request finishes with ``stop``.

    Raises:
        ValueError: on a value out of range, naming the field, the value and what is allowed.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        check(
            self.structured_outputs is None
            or isinstance(self.structured_outputs, StructuredOutputsParams),
            "structured_outputs",
            self.structured_outputs,
            "null or a StructuredOutputsParams",
        )
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        check_int("n", self.n, minimum=1)
        check(
            is_number(self.temperature)
            and math.isfinite(self.temperature)
            and self.temperature >= 0,
            "temperature",
            self.temperature,
            "a finite number >= 0 (0 is greedy)",
        )
        check(
            is_number(self.top_p) and 0 < self.top_p <= 1,
            "top_p",
            self.top_p,
            "a number in (0, 1]",
        )
        check(
            isinstance(self.top_k, int) and (self.top_k >= 0 or self.top_k == -1),
            "top_k",
            self.top_k,
            "an integer >= 0, or -1 (disabled)",
        )
        check_int("seed", self.seed, minimum=0, optional=True)
        check(
            self.seed is None or self.seed < 2**64,
            "seed",
            self.seed,
            "an integer in [0, 2**64) (a random generator's seed is 64 bits)",
        )
        check_int("max_tokens", self.max_tokens, minimum=1, optional=True)
        check_int("min_tokens", self.min_tokens, minimum=0)
        if self.max_tokens is not None:
            check(
                self.min_tokens <= self.max_tokens,
                "min_tokens",
                self.min_tokens,
                f"an integer <= max_tokens ({self.max_tokens})",
            )
        check(
            isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop),
            "stop",
            self.stop,
            "a string or a list of non-empty strings",
        )
        check(
            isinstance(self.stop_token_ids, list)
            and all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0
                for t in self.stop_token_ids
            ),
            "stop_token_ids",
            self.stop_token_ids,
            "a list of token ids >= 0",
        )
        OFFLINE_STOP_LIMITS.check(self.stop, self.stop_token_ids)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            check(
                value is None
                or (
                    isinstance(value, int)
                    and not isinstance(value, bool)
                    and 0 <= value <= MAX_LOGPROBS
                ),
                name,
                value,
                f"null or an integer in [0, {MAX_LOGPROBS}]",
            )
        self._check_logits_processing()

    def _check_logits_processing(self) -> None:
        check(
            is_number(self.repetition_penalty)
            and math.isfinite(self.repetition_penalty)
            and self.repetition_penalty > 0,
            "repetition_penalty",
            self.repetition_penalty,
            "a finite number > 0 (1 disables it)",
        )
        for name in ("frequency_penalty", "presence_penalty"):
            check(
                _finite_in(getattr(self, name), *PENALTY_RANGE),
                name,
                getattr(self, name),
                "a number in [-2, 2]",
            )
        bias = self.logit_bias
        check(isinstance(bias, dict), "logit_bias", bias, "a map of token id to bias")
        check(
            len(bias) <= MAX_LOGIT_BIAS_ENTRIES,
            "logit_bias",
            f"<{len(bias)} entries>",
            f"at most {MAX_LOGIT_BIAS_ENTRIES} entries",
        )
        for token, value in bias.items():
            check(
                isinstance(token, int) and not isinstance(token, bool) and token >= 0,
                "logit_bias",
                {token: value},
                "token ids >= 0 as keys",
            )
            check(
                _finite_in(value, *LOGIT_BIAS_RANGE),
                "logit_bias",
                {token: value},
                "bias values in [-100, 100]",
            )

    @property
    def greedy(self) -> bool:
        """True when ``temperature == 0``."""
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        """True when any of the repetition, frequency or presence penalties is on."""
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    @classmethod
    def from_dict(cls, values: dict) -> SamplingParams:
        """Build from a dict; an unknown field raises ``ValueError`` with close matches."""
        names = [f.name for f in dataclasses.fields(cls)]
        for key in values:
            if key not in names:
                raise unknown_key_error("sampling parameter", key, names)
        return cls(**values)
