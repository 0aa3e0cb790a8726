"""What a request's output must match: :class:`StructuredOutputsParams` (vLLM's field names) and
its grammar spec, checked without a tokenizer.

A request names one constraint: a JSON schema (``json``), any JSON object (``json_object``,
OpenAI's JSON mode), a regular expression (``regex``), one of a list of strings (``choice``) or
an EBNF grammar (``grammar``, xgrammar's dialect, GBNF-like). :meth:`StructuredOutputsParams.key`
reduces it to ``(kind, spec)``: ``kind`` in :data:`GRAMMAR_KINDS`, ``spec`` a string (a schema as
compact JSON in its own key order, a choice as the EBNF ``root ::= "a" | "b"``, as vLLM builds
it). That pair is what crosses the process line and what the engine's compile cache is keyed by.

:func:`check_grammar` parses the spec with xgrammar's tokenizer-free ``Grammar`` constructors, so
the server refuses a bad schema, regex or grammar with a 400 naming the problem before the engine
sees it; compiling against the vocabulary (the slow part) happens in the engine
(:mod:`fastdeploy.engine.structured_output`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

#: The kinds of :meth:`StructuredOutputsParams.key`.
GRAMMAR_KINDS = ("json", "json_object", "regex", "grammar")

#: What ``json_object`` compiles to: any JSON object (OpenAI's JSON mode answers an object, so
#: xgrammar's builtin JSON grammar, which also allows arrays and scalars, is not used).
JSON_OBJECT_SCHEMA = '{"type": "object"}'

#: xgrammar prefixes its errors with ``[time] /path/file.cc:line: ``; the rest is the problem.
_XGR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on a request's output (vLLM v0.11's ``StructuredOutputsParams`` names).

    Attributes:
        json: a JSON schema (dict, or its JSON text).
        regex: a regular expression the whole output matches.
        choice: the output is exactly one of these strings.
        grammar: an EBNF grammar (xgrammar's dialect; the start rule is ``root``).
        json_object: any JSON object (OpenAI's ``response_format: {"type": "json_object"}``).

    Raises:
        ValueError: none or more than one constraint set, or a value of the wrong type, naming
            the field and what is allowed.
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        if self.choice is not None:
            if not (
                isinstance(self.choice, (list, tuple))
                and self.choice
                and all(isinstance(c, str) and c for c in self.choice)
            ):
                raise ValueError(
                    f"choice={self.choice!r} is invalid; allowed: a non-empty list of non-empty "
                    "strings"
                )
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise ValueError(f"{name}={value!r} is invalid; allowed: a non-empty string")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(
                f"json={self.json!r} is invalid; allowed: a JSON schema (object or JSON text)"
            )
        set_fields = [n for n in _FIELDS if getattr(self, n) not in (None, False)]
        if len(set_fields) != 1:
            raise ValueError(
                f"structured_outputs sets {set_fields or 'nothing'}; allowed: exactly one of "
                f"{', '.join(_FIELDS)}"
            )

    def key(self) -> tuple[str, str]:
        """``(kind, spec)``: the constraint as plain strings (see the module docstring)."""
        if self.json_object:
            return ("json_object", "")
        if self.json is not None:
            schema = json.loads(self.json) if isinstance(self.json, str) else self.json
            # Key order kept: xgrammar emits properties in the schema's order.
            return ("json", json.dumps(schema, separators=(",", ":")))
        if self.regex is not None:
            return ("regex", self.regex)
        if self.choice is not None:
            # json.dumps escapes quotes and backslashes as an EBNF string literal wants them.
            return ("grammar", "root ::= " + " | ".join(json.dumps(c) for c in self.choice))
        return ("grammar", self.grammar)


_FIELDS = ("json", "regex", "choice", "grammar", "json_object")


def check_grammar(kind: str, spec: str) -> None:
    """Parse ``(kind, spec)`` with xgrammar (no tokenizer needed: milliseconds).

    Raises:
        ValueError: an unknown kind, a schema that is not JSON or that xgrammar cannot convert
            (e.g. ``Unsupported type "objectx"``), a regex or EBNF that does not parse; the
            message names the field and xgrammar's reason.
    """
    import xgrammar as xgr

    build = {
        "json": lambda s: xgr.Grammar.from_json_schema(s, strict_mode=True),
        "json_object": lambda s: xgr.Grammar.from_json_schema(
            JSON_OBJECT_SCHEMA, strict_mode=False
        ),
        "regex": xgr.Grammar.from_regex,
        "grammar": xgr.Grammar.from_ebnf,
    }
    if kind not in build:
        raise ValueError(f"grammar kind {kind!r} is invalid; allowed: {', '.join(build)}")
    if kind == "json":
        try:
            schema = json.loads(spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"json schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise ValueError(f"json schema is invalid: {spec[:80]}; allowed: a JSON object")
    try:
        build[kind](spec)
    except (RuntimeError, ValueError) as e:
        what = {"json": "json schema", "regex": "regex", "grammar": "grammar"}[kind]
        reason = _XGR_PREFIX.sub("", str(e).strip())
        raise ValueError(f"{what} is invalid: {reason}") from None
