"""Logprobs in OpenAI's two response formats, from the tokenizer's own token bytes.

Engine entries are ``{"token_id", "logprob", "top_logprobs": [(id, logprob), ...]}``. Token strings
and ``bytes`` come from :class:`~fastdeploy.engine.detokenizer.TokenBytes` (never from decoding one
token alone), so tokens that hold part of a UTF-8 character keep distinct, exact bytes.
"""

from __future__ import annotations

from fastdeploy.engine.detokenizer import TOKEN_ID_PREFIX, TextOffsets, TokenBytes
from fastdeploy.entrypoints.openai.protocol import CompletionLogprobs, TokenLogprob, TopLogprob


def _token(token_bytes: TokenBytes | None, token_id: int) -> tuple[str, list[int] | None]:
    """``(token string, its bytes)`` from the tokenizer's own token bytes; without a tokenizer
    ``("token_id:N", None)``."""
    if token_bytes is None:
        return f"{TOKEN_ID_PREFIX}{token_id}", None
    raw = token_bytes.bytes_of(token_id)
    return token_bytes.token_str(token_id), (list(raw) if raw is not None else None)


def chat_logprobs(token_bytes: TokenBytes | None, entries: list[dict] | None) -> list[TokenLogprob]:
    """Chat ``logprobs.content`` from engine entries
    ``{"token_id", "logprob", "top_logprobs": [(id, logprob), ...]}``: every one of the N
    alternatives, each with its exact ``bytes`` (tokens that hold part of a UTF-8 character are
    written ``bytes:\\xNN...``; two alternatives never share bytes)."""
    result = []
    for entry in entries or []:
        token, raw = _token(token_bytes, entry["token_id"])
        tops = []
        for tid, lp in entry.get("top_logprobs") or []:
            top_token, top_raw = _token(token_bytes, tid)
            tops.append(TopLogprob(token=top_token, logprob=lp, bytes=top_raw))
        result.append(
            TokenLogprob(token=token, logprob=entry["logprob"], bytes=raw, top_logprobs=tops)
        )
    return result


def completion_logprobs(
    token_bytes: TokenBytes | None, entries: list[dict] | None, offsets: TextOffsets | None
) -> CompletionLogprobs:
    """Legacy completions ``logprobs`` (tokens, token_logprobs, top_logprobs, text_offset).

    ``top_logprobs`` is a dict keyed by token string, as OpenAI's: the N alternatives plus the
    chosen token when it is not among them. Token strings come from the token's own bytes, so
    different tokens have different keys; should two still read the same (a tokenizer whose
    tokens share text), the later one is keyed ``token_id:N``. ``text_offset`` counts characters
    of the output text (see :class:`~fastdeploy.engine.detokenizer.TextOffsets`; pass one per
    response so a stream's chunks continue it; None: all 0).
    """
    out = CompletionLogprobs()
    for entry in entries or []:
        token_id = entry["token_id"]
        out.tokens.append(_token(token_bytes, token_id)[0])
        out.token_logprobs.append(entry["logprob"])
        tops: dict[str, float] = {}
        owner: dict[str, int] = {}
        pairs = list(entry.get("top_logprobs") or [])
        if all(tid != token_id for tid, _ in pairs):
            pairs.append((token_id, entry["logprob"]))
        for tid, lp in pairs:
            key = _token(token_bytes, tid)[0]
            if owner.get(key, tid) != tid:
                key = f"{TOKEN_ID_PREFIX}{tid}"
            owner[key] = tid
            tops[key] = lp
        out.top_logprobs.append(tops)
        out.text_offset.append(offsets.next(token_id) if offsets is not None else 0)
    return out
