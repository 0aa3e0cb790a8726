"""A small stand-in for ``LLMEngine`` to test the HTTP layer fast, without a model.

The tokenizer is character-level (token id = code point, vocabulary 0..255, eos 0). A request's
output is a fixed function of its prompt, so a batched request must produce exactly what it
produces alone. Each step emits one token per running request; ``step_delay_s`` makes steps slow
enough to disconnect in the middle of a stream. Which requests end, and the text they add, is
decided by the engine's real :class:`~fastdeploy.core.stop_checker.StopChecker`. A seeded
request's output depends on its seed too (:func:`fake_token`).
``prefix_block_size`` turns on a stand-in prefix cache: a request reports as
``num_cached_tokens`` the longest run of whole blocks of its prompt that an earlier request's
prompt began with (at most ``len(prompt) - 1`` tokens, as the real cache).
"""

from __future__ import annotations

import threading
import time

from fastdeploy.config import FDConfig
from fastdeploy.core.outputs import EngineOutput
from fastdeploy.core.request import Request, RequestStatus, check_prompt, check_sampling
from fastdeploy.core.stop_checker import StopChecker


class FakeTokenizer:
    """Characters are tokens; the chat template is ``role: content`` lines."""

    eos_token_id = 0
    all_special_ids = [0]

    def __len__(self) -> int:
        return 256

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [chr(i) for i in ids]

    def get_vocab(self) -> dict[str, int]:
        return {chr(i): i for i in range(256)}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % 256 for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i == 0))

    def apply_chat_template(
        self, messages, add_generation_prompt=True, tokenize=False, greeting=None
    ):
        """``greeting``: a template variable (``chat_template_kwargs``), written first."""
        if any(m["role"] == "assistant" and m["content"] == "BOOM" for m in messages):
            raise ValueError("template exploded")
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        text = (f"{greeting}\n" if greeting is not None else "") + text
        return text + ("assistant:" if add_generation_prompt else "")


def expected_text(prompt_ids: list[int], n: int, seed: int | None = None) -> str:
    """What the fake engine generates for ``prompt_ids`` in ``n`` tokens (with ``seed``)."""
    return FakeTokenizer().decode([fake_token(prompt_ids, i, seed) for i in range(n)])


def fake_token(prompt_ids: list[int], i: int, seed: int | None = None) -> int:
    """The ``i``-th output token of a prompt: a lowercase letter or a space; a seeded request's
    tokens depend on its seed too (so choices with their own seeds differ)."""
    k = (sum(prompt_ids) * 7 + i * 3 + (seed or 0) * 5) % 27
    return 32 if k == 26 else ord("a") + k


class _Plan:
    def to_dict(self) -> dict:
        return {"decode_graphs": False, "reasons": ["fake engine"]}


class FakeEngine:
    """Implements the ``LLMEngine`` methods the server uses; single-threaded like the real one."""

    def __init__(
        self,
        max_model_len: int = 128,
        num_blocks: int = 16,
        step_delay_s: float = 0.0,
        prefix_block_size: int = 0,
    ):
        self.tokenizer = FakeTokenizer()
        self.max_model_len = max_model_len
        self.vocab_size = 256
        self.config = FDConfig()
        self.plan = _Plan()
        self.step_delay_s = step_delay_s
        self.num_blocks = num_blocks
        self.max_model_len_note = None
        self.stop_checker = StopChecker(max_model_len, self.tokenizer)
        self.requests: dict[str, Request] = {}
        self.aborted: list[str] = []
        self.finished: dict[str, str] = {}  # request id -> finish reason
        self.added_at_step: dict[str, int] = {}  # request id -> steps run before it was added
        self.steps = 0
        self.fail_next_step = False
        self.is_shut_down = False
        self.thread_ids: set[int] = set()
        self.prefix_block_size = prefix_block_size  # 0: no prefix cache
        self.cached_prefixes: set[tuple[int, ...]] = set()

    def _touch(self) -> None:
        self.thread_ids.add(threading.get_ident())

    def check_request(self, prompt_token_ids: list[int], sampling_params=None) -> None:
        """The real engine's admission check (pure: not recorded in ``thread_ids``)."""
        check_prompt(prompt_token_ids, self.max_model_len, self.vocab_size)
        if sampling_params is not None:
            check_sampling(sampling_params, self.vocab_size, self.tokenizer is not None)

    def add_request(self, request_id, prompt_token_ids, sampling_params):
        self._touch()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        request = Request(
            request_id, list(prompt_token_ids), sampling_params, eos_token_ids=frozenset({0})
        )
        request.num_cached_tokens = self._cache_prefixes(request.prompt_token_ids)
        self.added_at_step[request_id] = self.steps
        self.stop_checker.start(request)
        self.requests[request_id] = request

    def _cache_prefixes(self, prompt: list[int]) -> int:
        """Tokens of ``prompt`` found in the stand-in prefix cache; caches its whole blocks."""
        size = self.prefix_block_size
        if not size:
            return 0
        prefixes = [tuple(prompt[:end]) for end in range(size, len(prompt) + 1, size)]
        hits = 0
        for prefix in prefixes:
            if len(prefix) >= len(prompt) or prefix not in self.cached_prefixes:
                break
            hits = len(prefix)
        self.cached_prefixes.update(prefixes)
        return hits

    def abort_request(self, request_id: str) -> bool:
        self._touch()
        self.aborted.append(request_id)
        return self.requests.pop(request_id, None) is not None

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[EngineOutput]:
        self._touch()
        if self.fail_next_step:
            raise RuntimeError("simulated device failure")
        time.sleep(self.step_delay_s)
        self.steps += 1
        outputs = []
        for rid, request in list(self.requests.items()):
            seed = request.sampling_params.seed
            tok = fake_token(request.prompt_token_ids, len(request.output_token_ids), seed)
            request.output_token_ids.append(tok)
            logprobs = None
            params = request.sampling_params
            if params.logprobs is not None:
                top = [(tok, -0.25), (ord("z"), -2.0)][: params.logprobs]
                logprobs = [{"token_id": tok, "logprob": -0.25, "top_logprobs": top}]
            status: RequestStatus | None = self.stop_checker.check(request, tok)
            done = status is not None
            if done:
                del self.requests[rid]
                self.finished[rid] = status.value
            outputs.append(
                EngineOutput(
                    rid,
                    [tok],
                    logprobs,
                    done,
                    status.value if done else None,
                    request.num_prompt_tokens,
                    request.num_cached_tokens,
                    new_text=request.detokenizer.take_delta(done),
                    stop_reason=request.stop_reason if done else None,
                )
            )
        return outputs

    def get_stats(self) -> dict:
        used = len(self.requests)
        return {
            "num_running": used,
            "num_waiting": 0,
            "kv_cache_usage": used / self.num_blocks,
            "num_free_blocks": self.num_blocks - used,
            "num_total_blocks": self.num_blocks,
            "steps_by_mode": {"eager": self.steps},
            "num_padded_tokens": 2 * self.steps,
        }

    def shutdown(self) -> None:
        self.is_shut_down = True
