"""The harness under a JSON schema (``--json-schema``): HF float32's greedy continuation
constrained by the same grammar our engine applies, with log-probs and top-2 margins taken from
the masked distribution, so that every path's greedy answer under structured output is compared
with what the model says under that grammar (docs/structured-output.md).

The grammar is compiled here by xgrammar from the HF tokenizer, with the options the engine uses
for a ``json`` constraint (``any_whitespace=False``, ``strict_mode=True``:
``fastdeploy/engine/structured_output.py``). The decoding loop is our own (not xgrammar's
``contrib.hf.LogitsProcessor``) because the scorer needs each position's masked log-probs and
top-2 margin, which ``generate`` does not return.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

#: The built-in schema (``--json-schema builtin``): nested object, enum, array, integer.
BUILTIN_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "zip": {"type": "integer", "minimum": 0, "maximum": 99999},
            },
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "role", "tags", "address"],
}


def load_schema(arg: str) -> dict[str, Any]:
    """``--json-schema``: ``builtin``, a path to a JSON file, or inline JSON.

    Raises:
        ValueError: the value is none of these, or is not a JSON object.
    """
    if arg == "builtin":
        return BUILTIN_SCHEMA
    text = Path(arg).read_text() if Path(arg).is_file() else arg
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--json-schema {arg!r} is invalid: {e}; allowed: builtin, a file "
                         "or inline JSON") from e  # fmt: skip
    if not isinstance(schema, dict):
        raise ValueError(f"--json-schema {arg!r} is a {type(schema).__name__}; allowed: an object")
    return schema


def compile_schema(tokenizer: Any, vocab_size: int, schema: dict[str, Any]) -> Any:
    """xgrammar's ``CompiledGrammar`` of ``schema`` for ``tokenizer`` and logits of width
    ``vocab_size`` (>= the tokenizer's vocabulary)."""
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    compiler = xgr.GrammarCompiler(info)
    return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)


@torch.inference_mode()
def constrained_greedy(
    hf: torch.nn.Module,
    ids: Sequence[int],
    max_new_tokens: int,
    eos_ids: Sequence[int],
    compiled: Any,
) -> tuple[list[int], list[float], list[float]]:
    """HF's greedy continuation of ``ids`` under ``compiled`` (one token per forward, KV cache).

    At each position the disallowed tokens' logits (float32) become ``-inf`` (xgrammar's bitmask),
    the token is the masked argmax, its log-prob is from the masked log-softmax, and the margin is
    the masked top-2 margin (nats; ``inf`` where the grammar allows one token). Stops after an eos
    or when the grammar has terminated, as the engine does.

    Returns:
        ``(tokens, logprobs, margins)``, one entry per generated token.
    """
    import xgrammar as xgr

    device = next(hf.parameters()).device
    matcher = xgr.GrammarMatcher(compiled)
    head = hf.get_output_embeddings()
    vocab = head.weight.shape[0]
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    x = torch.tensor([list(ids)], device=device)
    past = None
    tokens: list[int] = []
    logprobs: list[float] = []
    margins: list[float] = []
    for _ in range(max_new_tokens):
        out = hf.model(input_ids=x, past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits = head(out.last_hidden_state[:, -1]).float().cpu()
        matcher.fill_next_token_bitmask(bitmask)
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        lp = torch.log_softmax(logits[0], dim=-1)
        top = lp.topk(2)
        tok = int(top.indices[0])
        tokens.append(tok)
        logprobs.append(float(top.values[0]))
        second = float(top.values[1])
        margins.append(float("inf") if second == float("-inf") else float(top.values[0]) - second)
        if tok in eos_ids or not matcher.accept_token(tok) or matcher.is_terminated():
            break
        x = torch.tensor([[tok]], device=device)
    return tokens, logprobs, margins
