"""The one owner of the stop decision: its order, min_tokens, the final step, streaming hold-back.

A character tokenizer (token id = code point, 0 = eos, a special token) drives the real
:class:`StopChecker` and :class:`IncrementalDetokenizer` (its re-decode path; the default model's
tests cover the ``DecodeStream`` path).
"""

from __future__ import annotations

import pytest

from fastdeploy.core.request import Request, RequestStatus
from fastdeploy.core.sampling_params import SamplingParams
from fastdeploy.core.stop_checker import StopChecker, find_stop_string

EOS = 0


class CharTokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i == EOS))


def start(max_model_len: int = 100, prompt: str = "q", **params) -> tuple[StopChecker, Request]:
    checker = StopChecker(max_model_len, CharTokenizer())
    request = Request(
        "r", [ord(c) for c in prompt], SamplingParams(**params), eos_token_ids=frozenset({EOS})
    )
    checker.start(request)
    return checker, request


def feed(checker: StopChecker, request: Request, tokens) -> tuple[RequestStatus | None, list[str]]:
    """Append tokens one by one as the engine does; stop at the first finish. Returns the status
    and the streamed text deltas."""
    deltas = []
    status = None
    for t in tokens:
        tok = ord(t) if isinstance(t, str) else t
        request.output_token_ids.append(tok)
        status = checker.check(request, tok)
        deltas.append(request.detokenizer.take_delta(status is not None))
        if status is not None:
            break
    return status, deltas


def test_stop_string_on_the_last_step_wins_over_length():
    checker, req = start(max_tokens=7, stop=["Paris"])
    status, deltas = feed(checker, req, "a Paris")  # "s", token 7, completes the stop string
    assert status == RequestStatus.FINISHED_STOPPED and req.stop_reason == "Paris"
    assert "".join(deltas) == req.detokenizer.text == "a "
    assert len(req.output_token_ids) == 7


def test_stop_token_and_eos_on_the_last_step_win_over_length_and_add_no_text():
    checker, req = start(max_tokens=3, stop_token_ids=[ord("x")])
    status, deltas = feed(checker, req, "abx")
    assert status == RequestStatus.FINISHED_STOPPED and req.stop_reason == ord("x")
    assert "".join(deltas) == "ab"
    checker, req = start(max_tokens=3, skip_special_tokens=False)
    status, deltas = feed(checker, req, ["a", "b", EOS])
    assert status == RequestStatus.FINISHED_STOPPED and req.stop_reason is None
    assert "".join(deltas) == "ab"  # eos text (here "\x00") is never added


def test_order_eos_then_stop_token_then_stop_string_then_length():
    """One token that is eos, a stop token id and completes a stop string, on the last step:
    eos decides (no stop_reason); without eos, the stop token id; then the string."""
    tokens = ["a", EOS]
    checker, req = start(max_tokens=2, stop_token_ids=[EOS], stop=["a\x00"])
    status, _ = feed(checker, req, tokens)
    assert (status, req.stop_reason) == (RequestStatus.FINISHED_STOPPED, None)
    checker, req = start(max_tokens=2, ignore_eos=True, stop_token_ids=[EOS], stop=["a\x00"])
    status, _ = feed(checker, req, tokens)
    assert (status, req.stop_reason) == (RequestStatus.FINISHED_STOPPED, EOS)
    checker, req = start(max_tokens=2, ignore_eos=True, stop=["a\x00"], skip_special_tokens=False)
    status, _ = feed(checker, req, tokens)
    assert (status, req.stop_reason) == (RequestStatus.FINISHED_STOPPED, "a\x00")
    checker, req = start(max_tokens=2, ignore_eos=True)
    assert feed(checker, req, tokens)[0] == RequestStatus.FINISHED_LENGTH


def test_min_tokens_gates_eos_stop_tokens_and_stop_strings():
    checker, req = start(max_tokens=20, min_tokens=5, stop=["cd", "ab"], stop_token_ids=[ord("!")])
    # eos at 2, "ab" at 3-4, "!" at 5: none may end it before the 6th token.
    status, deltas = feed(checker, req, ["x", EOS, "a", "b", "!"])
    assert status is None
    # "ab" lies wholly in the first 5 tokens: it is never matched later; "cd" is, at token 7.
    status, deltas = feed(checker, req, "cdz")
    assert status == RequestStatus.FINISHED_STOPPED and req.stop_reason == "cd"
    assert req.detokenizer.text == "xab!" and len(req.output_token_ids) == 7


def test_a_stop_string_may_start_before_min_tokens_and_end_after():
    checker, req = start(max_tokens=20, min_tokens=3, stop=["abc"])
    status, _ = feed(checker, req, "xabc")  # "abc" ends at token 4 > min_tokens
    assert status == RequestStatus.FINISHED_STOPPED and req.detokenizer.text == "x"


def test_max_model_len_ends_with_length():
    checker, req = start(max_model_len=10, prompt="12345678", max_tokens=None)
    status, _ = feed(checker, req, "abc")
    assert status == RequestStatus.FINISHED_LENGTH and len(req.output_token_ids) == 2


def test_streaming_never_shows_part_of_a_stop_string():
    checker, req = start(max_tokens=50, stop=["STOP"])
    status, deltas = feed(checker, req, "abcSTxyzSTOPq")
    assert status == RequestStatus.FINISHED_STOPPED
    final = "abcSTxyz"
    assert "".join(deltas) == final
    # Every stream prefix is a prefix of the final text: "STO" was never shown, though "ST" of
    # "abcST" was once it could no longer begin "STOP".
    for i in range(len(deltas)):
        assert final.startswith("".join(deltas[: i + 1]))
    assert "".join(deltas[:11]) == "abcSTxyz"  # at "...STO" the held-back window hides "STO"


@pytest.mark.parametrize(
    "text, new, stops, expected",
    [
        ("hello world", 5, ["world"], (6, "world")),
        ("hello world", 3, ["hello"], None),  # ends outside the new characters
        ("hello world", 11, ["o", "l"], (2, "l")),  # the earliest start wins
        ("abcabc", 1, ["abc"], (3, "abc")),
        ("abc", 0, ["abc"], None),
    ],
)
def test_find_stop_string(text, new, stops, expected):
    assert find_stop_string(text, new, stops) == expected
