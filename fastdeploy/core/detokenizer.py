"""Tokens to text: the incremental detokenizer of a request, and the exact bytes of each token.

:class:`IncrementalDetokenizer` turns a request's output tokens into text one token at a time
(the ``tokenizers`` library's ``DecodeStream`` where the tokenizer has a fast backend, about
0.8 us per token with SmolLM2's tokenizer on CPU; else re-decoding the whole output). It lives on
the :class:`~fastdeploy.core.request.Request`, so it survives preemption, and the engine's
:class:`~fastdeploy.core.stop_checker.StopChecker` drives it.

:class:`TokenBytes` gives the bytes a token stands for, read from the tokenizer's own vocabulary
(byte-level BPE symbols mapped back to bytes, SentencePiece ``<0xNN>`` byte tokens and ``▁``),
never from decoding one token alone: a token holding part of a UTF-8 character decodes to
``"\\ufffd"`` on its own, so different tokens would look the same.
"""

from __future__ import annotations

import codecs
import json
import re
from functools import lru_cache
from typing import Any

#: How a token that is not valid UTF-8 on its own is written as a string (OpenAI's form).
BYTES_PREFIX = "bytes:"
#: How a token id with no entry in the tokenizer is written as a string.
TOKEN_ID_PREFIX = "token_id:"


class IncrementalDetokenizer:
    """The text of one request's output, grown token by token.

    Args:
        tokenizer: a ``transformers`` tokenizer.
        skip_special_tokens: leave special tokens out of the text.
        hold: characters kept back from :meth:`take_delta` until the request ends (the longest
            stop string minus one), so that a stop string is never streamed in part.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool, hold: int = 0) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.hold = hold
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0  # characters already handed out by take_delta
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stream = None
        if self._backend is not None:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def add(self, token_id: int) -> int:
        """Append one token; returns how many characters the text grew by (0 while a UTF-8
        character is still incomplete)."""
        self.ids.append(token_id)
        if self._stream is not None:
            piece = self._stream.step(self._backend, token_id)
            if not piece:
                return 0
            self.text += piece
            return len(piece)
        before = len(self.text)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip_special_tokens)
        if not text.endswith("\ufffd"):
            self.text = text
        return len(self.text) - before

    def truncate(self, num_chars: int) -> None:
        """Cut the text to its first ``num_chars`` characters (a stop string was found)."""
        self.text = self.text[:num_chars]

    def take_delta(self, finished: bool) -> str:
        """The text not handed out yet, less the last ``hold`` characters unless ``finished``."""
        visible = len(self.text) if finished else max(self.sent, len(self.text) - self.hold)
        delta = self.text[self.sent : visible]
        self.sent = visible
        return delta


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-to-unicode table, inverted: the symbol of each byte in byte-level BPE
    vocabularies -> the byte (Radford et al. 2019, ``encoder.py`` of openai/gpt-2)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    codes, n = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, codes)}


_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _decoder_kinds(tokenizer: Any) -> set[str]:
    """The ``type`` names in the fast tokenizer's decoder (a Sequence is flattened)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return set()
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    return {p.get("type") for p in parts if isinstance(p, dict)}


class TokenBytes:
    """Token id -> the exact bytes it stands for, and an unambiguous string for logprobs.

    Built once from the vocabulary (about 0.1 s for 49k tokens), on first use. Byte-level BPE
    (GPT-2, Llama 3, Qwen, SmolLM): each symbol maps back to one byte. SentencePiece with byte
    fallback (Llama 2, Mistral): ``<0xNN>`` is byte ``NN`` and ``▁`` a space. Added and special
    tokens: their content in UTF-8. Other tokenizers: the one-token decode, in UTF-8 (the only
    case where two tokens may share bytes).

    Args:
        tokenizer: a ``transformers`` tokenizer.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._table: list[bytes] | None = None

    def _build(self) -> list[bytes]:
        tok = self.tokenizer
        kinds = _decoder_kinds(tok)
        byte_level = _byte_level_decoder() if "ByteLevel" in kinds else None
        added = {i: t.content for i, t in getattr(tok, "added_tokens_decoder", {}).items()}
        symbols = tok.convert_ids_to_tokens(list(range(len(tok))))
        table = []
        for token_id, symbol in enumerate(symbols):
            if token_id in added:
                table.append(added[token_id].encode("utf-8"))
            elif symbol is None:
                table.append(b"")
            elif byte_level is not None and all(c in byte_level for c in symbol):
                table.append(bytes(byte_level[c] for c in symbol))
            elif "ByteFallback" in kinds and _BYTE_TOKEN.match(symbol):
                table.append(bytes([int(symbol[3:5], 16)]))
            elif "Metaspace" in kinds or "Replace" in kinds:
                table.append(symbol.replace("▁", " ").encode("utf-8"))
            else:
                table.append(tok.decode([token_id], skip_special_tokens=False).encode("utf-8"))
        return table

    def __len__(self) -> int:
        if self._table is None:
            self._table = self._build()
        return len(self._table)

    def bytes_of(self, token_id: int) -> bytes | None:
        """The token's bytes, or None for an id the tokenizer does not have (a model's padded
        vocabulary rows)."""
        if self._table is None:
            self._table = self._build()
        return self._table[token_id] if 0 <= token_id < len(self._table) else None

    def token_str(self, token_id: int) -> str:
        """The token as a string: its bytes decoded when they are valid UTF-8 on their own, else
        ``bytes:\\xNN...`` (as OpenAI writes such tokens); ``token_id:N`` for an id the tokenizer
        does not have."""
        raw = self.bytes_of(token_id)
        if raw is None:
            return f"{TOKEN_ID_PREFIX}{token_id}"
        return bytes_to_str(raw)


@lru_cache(maxsize=4096)
def bytes_to_str(raw: bytes) -> str:
    """``raw`` decoded as UTF-8, or ``bytes:\\xNN...`` when it is not valid UTF-8 on its own."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return BYTES_PREFIX + "".join(f"\\x{b:02x}" for b in raw)


class TextOffsets:
    """Character offset of each token in the output text, from the tokens' bytes: a token that
    ends inside a UTF-8 character adds nothing until the character is complete, so offsets index
    the decoded text. Special tokens add nothing when ``skip_special_tokens`` (the text leaves them
    out). Keep one per response: a stream's chunks continue the same count.

    Args:
        token_bytes: the tokenizer's :class:`TokenBytes`.
        skip_special_ids: ids that add no text (the tokenizer's special ids when
            ``skip_special_tokens``).
        start: offset of the first token.
    """

    def __init__(self, token_bytes: TokenBytes, skip_special_ids=(), start: int = 0) -> None:
        self.token_bytes = token_bytes
        self.skip = frozenset(skip_special_ids)
        self.offset = start
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def next(self, token_id: int) -> int:
        """The offset of ``token_id`` (the next token of the text); advances past it."""
        offset = self.offset
        raw = self.token_bytes.bytes_of(token_id)
        if raw and token_id not in self.skip:
            self.offset += len(self._decoder.decode(raw))
        return offset
