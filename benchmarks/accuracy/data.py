"""The accuracy harness's fixed data: ``prompts.jsonl`` and the public-domain perplexity text.

A record of ``prompts.jsonl`` is one JSON object a line::

    {"id": 0, "kind": "chat", "messages": [{"role": "user", "content": "..."}], "num_tokens": 37}
    {"id": 6, "kind": "text", "prompt": "The quick brown fox ...", "num_tokens": 19}

``num_tokens`` is the prompt's length under the default model's tokenizer, tokenized exactly as
:func:`prompt_token_ids` does (the way ``LLM.chat`` and ``LLM.generate`` do: a chat through the
model's chat template with the generation prompt, then ``encode(add_special_tokens=False)``).
``python benchmarks/accuracy/data.py --recount`` measures and rewrites them.

The prompts were written for this harness (long ones are windows of ``public_domain.txt``, which is
public domain; see ``README.md`` in this folder).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DATA_DIR = Path(__file__).resolve().parent
PROMPTS_FILE = DATA_DIR / "prompts.jsonl"
TEXT_FILE = DATA_DIR / "public_domain.txt"
#: The data set's promised range of prompt lengths (tokens, default tokenizer), both ends included.
MIN_PROMPT_TOKENS, MAX_PROMPT_TOKENS = 16, 2000
KINDS = ("chat", "text")


@dataclass(frozen=True)
class PromptRecord:
    """One prompt of the data set: ``messages`` for a chat, ``prompt`` for plain text."""

    id: int
    kind: str
    num_tokens: int
    messages: tuple[dict[str, str], ...] = ()
    prompt: str = ""

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> PromptRecord:
        """Raises ``ValueError`` on an unknown kind or a record missing its content."""
        kind = obj.get("kind")
        if kind not in KINDS:
            raise ValueError(f"prompt record {obj.get('id')}: kind={kind!r}; allowed: {KINDS}")
        field = "messages" if kind == "chat" else "prompt"
        if not obj.get(field):
            raise ValueError(f"prompt record {obj.get('id')}: a {kind} record needs {field!r}")
        return cls(
            id=int(obj["id"]),
            kind=kind,
            num_tokens=int(obj.get("num_tokens", 0)),
            messages=tuple(obj.get("messages", ())),
            prompt=obj.get("prompt", ""),
        )

    def to_json(self) -> dict[str, Any]:
        body = {"messages": list(self.messages)} if self.kind == "chat" else {"prompt": self.prompt}
        return {"id": self.id, "kind": self.kind, **body, "num_tokens": self.num_tokens}


def load_prompts(path: Path = PROMPTS_FILE) -> list[PromptRecord]:
    """Every record of ``prompts.jsonl`` in file order (ids are the line numbers)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    return [PromptRecord.from_json(json.loads(line)) for line in lines if line.strip()]


def select_prompts(
    records: Sequence[PromptRecord], num_prompts: int | None, max_prompt_tokens: int | None = None
) -> list[PromptRecord]:
    """The first ``num_prompts`` records (all when None) of at most ``max_prompt_tokens`` tokens.

    Raises:
        ValueError: fewer records qualify than were asked for.
    """
    fit = [r for r in records if max_prompt_tokens is None or r.num_tokens <= max_prompt_tokens]
    if num_prompts is None:
        return fit
    if num_prompts > len(fit):
        raise ValueError(
            f"num_prompts={num_prompts} but only {len(fit)} prompts have at most "
            f"{max_prompt_tokens} tokens"
        )
    return fit[:num_prompts]


def prompt_token_ids(tokenizer: Any, record: PromptRecord) -> list[int]:
    """The record's token ids as the offline API makes them (see the module docstring)."""
    if record.kind == "chat":
        text = tokenizer.apply_chat_template(
            list(record.messages), tokenize=False, add_generation_prompt=True
        )
    else:
        text = record.prompt
    return list(tokenizer.encode(text, add_special_tokens=False))


def text_token_ids(tokenizer: Any, max_tokens: int | None = None) -> list[int]:
    """The perplexity text's first ``max_tokens`` token ids (all when None)."""
    ids = list(tokenizer.encode(TEXT_FILE.read_text(encoding="utf-8"), add_special_tokens=False))
    return ids if max_tokens is None else ids[:max_tokens]


def recount(tokenizer: Any, path: Path = PROMPTS_FILE) -> list[PromptRecord]:
    """Measure every record's ``num_tokens`` and rewrite ``path``; returns the new records."""
    records = [
        PromptRecord(r.id, r.kind, len(prompt_token_ids(tokenizer, r)), r.messages, r.prompt)
        for r in load_prompts(path)
    ]
    lines = [json.dumps(r.to_json(), ensure_ascii=False) for r in records]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return records


if __name__ == "__main__":
    import argparse

    from fastdeploy.model_executor.model_loader.source import resolve_model

    parser = argparse.ArgumentParser(description="measure prompts.jsonl under a tokenizer")
    parser.add_argument("--recount", action="store_true", help="rewrite num_tokens")
    parser.add_argument("--model", default=None, help="GGUF file (default: the bundled one)")
    args = parser.parse_args()
    tok = resolve_model(args.model, "auto").load_tokenizer()
    recs = recount(tok) if args.recount else load_prompts()
    lengths = sorted(r.num_tokens for r in recs)
    print(
        f"{len(recs)} prompts, {lengths[0]}..{lengths[-1]} tokens; text: "
        f"{len(text_token_ids(tok))} tokens"
    )
