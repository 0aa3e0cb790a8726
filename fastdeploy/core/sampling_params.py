"""Per-request sampling parameters (names follow FastDeploy / vLLM / the OpenAI API)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from fastdeploy.config import check, check_int, unknown_key_error


@dataclass
class SamplingParams:
    """How to pick tokens for one request.

    ``temperature=0`` is greedy. ``top_k=0`` (or -1) disables top-k; ``top_p=1`` disables top-p.
    ``seed`` makes a sampled request reproducible whatever it is batched with. ``logprobs=N``
    returns the log-probability of the chosen token and of the top N tokens at each step
    (N <= 20). ``stop`` strings end generation and are cut from the text; ``stop_token_ids`` end it
    too. ``ignore_eos`` keeps generating past eos (benchmarks).

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
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        check(self.n == 1, "n", self.n, "1")
        check(
            isinstance(self.temperature, (int, float)) and self.temperature >= 0,
            "temperature",
            self.temperature,
            "a number >= 0",
        )
        check(
            isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1,
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
        check_int("max_tokens", self.max_tokens, minimum=1, optional=True)
        check_int("min_tokens", self.min_tokens, minimum=0)
        check(
            isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop),
            "stop",
            self.stop,
            "a string or a list of non-empty strings",
        )
        check(
            isinstance(self.stop_token_ids, list)
            and all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            self.stop_token_ids,
            "a list of token ids >= 0",
        )
        check(
            self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
            "logprobs",
            self.logprobs,
            "null or an integer in [0, 20]",
        )

    @property
    def greedy(self) -> bool:
        """True when ``temperature == 0``."""
        return self.temperature == 0

    @classmethod
    def from_dict(cls, values: dict) -> SamplingParams:
        """Build from a dict; an unknown field raises ``ValueError`` with close matches."""
        names = [f.name for f in dataclasses.fields(cls)]
        for key in values:
            if key not in names:
                raise unknown_key_error("sampling parameter", key, names)
        return cls(**values)
