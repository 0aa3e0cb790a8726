"""Logprobs in OpenAI's two response formats, from the tokenizer's own token bytes.

Engine entries are ``{"token_id", "logprob", "top_logprobs": [(id, logprob), ...]}``. Token strings
and ``bytes`` come from :class:`~fastdeploy.core.detokenizer.TokenBytes` (never from decoding one
token alone), so tokens that hold part of a UTF-8 character keep distinct, exact bytes.

Both functions return plain JSON-ready values with the fields, in order, of the protocol models
(:class:`~fastdeploy.entrypoints.openai.protocol_responses.TokenLogprob`,
:class:`~fastdeploy.entrypoints.openai.protocol_responses.CompletionLogprobs`): streamed chunks
encode them as they are, and whole responses validate them into those models.
"""

from __future__ import annotations

from typing import Any

from fastdeploy.core.detokenizer import TOKEN_ID_PREFIX, TextOffsets, TokenBytes


def _token(token_bytes: TokenBytes | None, token_id: int) -> tuple[str, list[int] | None]:
    """``(token string, its bytes)`` from the tokenizer's own token bytes; without a tokenizer
    ``("token_id:N", None)``."""
    if token_bytes is None:
        return f"{TOKEN_ID_PREFIX}{token_id}", None
    raw = token_bytes.bytes_of(token_id)
    return token_bytes.token_str(token_id), (list(raw) if raw is not None else None)


def chat_logprobs(
    token_bytes: TokenBytes | None, entries: list[dict] | None
) -> list[dict[str, Any]]:
    """Chat ``logprobs.content`` from engine entries
    ``{"token_id", "logprob", "top_logprobs": [(id, logprob), ...]}``: every one of the N
    alternatives, each with its exact ``bytes`` (tokens that hold part of a UTF-8 character are
    written ``bytes:\\xNN...``; two alternatives never share bytes). Each item is a
    ``TokenLogprob`` as a dict: ``{"token", "logprob", "bytes", "top_logprobs": [{"token",
    "logprob", "bytes"}, ...]}``."""
    result = []
    for entry in entries or []:
        token, raw = _token(token_bytes, entry["token_id"])
        tops = []
        for tid, lp in entry.get("top_logprobs") or []:
            top_token, top_raw = _token(token_bytes, tid)
            tops.append({"token": top_token, "logprob": float(lp), "bytes": top_raw})
        result.append(
            {"token": token, "logprob": float(entry["logprob"]), "bytes": raw, "top_logprobs": tops}
        )
    return result


def completion_logprobs(
    token_bytes: TokenBytes | None, entries: list[dict] | None, offsets: TextOffsets | None
) -> dict[str, list]:
    """Legacy completions ``logprobs`` (tokens, token_logprobs, top_logprobs, text_offset).

    ``top_logprobs`` is a dict keyed by token string, as OpenAI's: the N alternatives plus the
    chosen token when it is not among them. Token strings come from the token's own bytes, so
    different tokens have different keys; should two still read the same (a tokenizer whose
    tokens share text), the later one is keyed ``token_id:N``. ``text_offset`` counts characters
    of the output text (see :class:`~fastdeploy.core.detokenizer.TextOffsets`; pass one per
    response so a stream's chunks continue it; None: all 0). Returns a ``CompletionLogprobs`` as
    a dict: ``{"text_offset", "token_logprobs", "tokens", "top_logprobs"}``.
    """
    offsets_out: list[int] = []
    token_logprobs: list[float] = []
    tokens: list[str] = []
    top_logprobs: list[dict[str, float]] = []
    for entry in entries or []:
        token_id = entry["token_id"]
        tokens.append(_token(token_bytes, token_id)[0])
        token_logprobs.append(float(entry["logprob"]))
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
            tops[key] = float(lp)
        top_logprobs.append(tops)
        offsets_out.append(offsets.next(token_id) if offsets is not None else 0)
    return {
        "text_offset": offsets_out,
        "token_logprobs": token_logprobs,
        "tokens": tokens,
        "top_logprobs": top_logprobs,
    }


def vllm_prompt_logprobs(
    token_bytes: TokenBytes | None, entries: list[dict | None] | None
) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's ``prompt_logprobs`` from the engine's (``RequestOutput.prompt_logprobs``): per
    prompt token None (the first) or ``{token id as a string: {"logprob", "rank",
    "decoded_token"}}``, the prompt token first (its own rank), then the top N not already in
    (ranks 1..N). None when ``entries`` is None."""
    if entries is None:
        return None
    result: list[dict[str, dict[str, Any]] | None] = []
    for entry in entries:
        if entry is None:
            result.append(None)
            continue
        token_id = entry["token_id"]
        ranked = [(token_id, entry["logprob"], entry.get("rank"))]
        ranked += [
            (t, lp, r) for r, (t, lp) in enumerate(entry["top_logprobs"], 1) if t != token_id
        ]
        result.append(
            {
                str(t): {
                    "logprob": float(lp),
                    "rank": r,
                    "decoded_token": _token(token_bytes, t)[0],
                }
                for t, lp, r in ranked
            }
        )
    return result


def echo_logprobs(
    token_bytes: TokenBytes | None,
    prompt_token_ids: list[int],
    prompt_entries: list[dict | None],
    entries: list[dict] | None,
    num_top: int,
    prompt_offsets: TextOffsets | None,
    offsets: TextOffsets | None,
) -> dict[str, list]:
    """Legacy completions ``logprobs`` of an ``echo`` response (OpenAI's): the prompt's tokens
    first, the first one with a null log-probability and null top log-probabilities, then the
    generated ones (:func:`completion_logprobs` of each part, tops cut to ``num_top``).
    ``prompt_offsets`` counts the prompt text's characters and ``offsets`` goes on from its end."""
    first = prompt_token_ids[0]
    head = {
        "text_offset": [prompt_offsets.next(first) if prompt_offsets is not None else 0],
        "token_logprobs": [None],
        "tokens": [_token(token_bytes, first)[0]],
        "top_logprobs": [None],
    }
    cut = [{**e, "top_logprobs": e["top_logprobs"][:num_top]} for e in prompt_entries[1:]]
    parts = [
        head,
        completion_logprobs(token_bytes, cut, prompt_offsets),
        completion_logprobs(token_bytes, entries, offsets),
    ]
    return {key: [v for part in parts for v in part[key]] for key in head}
