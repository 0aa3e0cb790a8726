"""A request's structured-output fields -> one checked :class:`StructuredOutputsParams`.

Forms accepted (at most one per request; two is a 400 naming both):

* OpenAI's ``response_format``: ``{"type": "json_object"}``, or ``{"type": "json_schema",
  "json_schema": {"name": ..., "schema": {...}, "strict": bool}}``. ``strict`` is accepted either
  way: the output is always constrained to the schema (xgrammar's strict mode: no properties
  beyond the schema's), which is what ``strict: true`` promises; ``{"type": "text"}`` is none.
* vLLM's ``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``, ``json_object``)
  and its older ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``.

The spec is parsed here, in the server process (:func:`check_grammar`, tokenizer-free, cached), so
a bad schema, regex or grammar is a 400 naming xgrammar's reason and never reaches the engine.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from fastdeploy.core.structured_output import StructuredOutputsParams, check_grammar
from fastdeploy.entrypoints.openai.errors import bad_request

_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def _from_response_format(fmt: dict[str, Any]) -> dict[str, Any] | None:
    kind = fmt.get("type")
    extra = set(fmt) - {"type", "json_schema"}
    if extra:
        raise bad_request(
            f"response_format has unknown fields {sorted(extra)}; allowed: type, json_schema",
            "response_format",
        )
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise bad_request(
            'response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}; '
            f"got {spec!r}",
            "response_format",
        )
    unknown = set(spec) - {"name", "schema", "strict", "description"}
    if unknown:
        raise bad_request(
            f"response_format.json_schema has unknown fields {sorted(unknown)}; allowed: "
            "name, schema, strict, description",
            "response_format",
        )
    return {"json": spec["schema"]}


@lru_cache(maxsize=256)
def _checked(kind: str, spec: str) -> None:
    check_grammar(kind, spec)  # raises ValueError; an lru_cache does not cache exceptions


def structured_outputs_from(req: Any) -> StructuredOutputsParams | None:
    """The request's one constraint, parsed and checked, or None.

    Raises:
        APIError: 400 for two constraints, an unknown ``structured_outputs`` key, a malformed
            ``response_format``, or a schema, regex or grammar xgrammar cannot parse (the
            message says which and why, ``param`` names the field it came from).
    """
    found: list[tuple[str, dict[str, Any]]] = []
    if req.response_format is not None:
        values = _from_response_format(req.response_format)
        if values is not None:
            found.append(("response_format", values))
    if req.structured_outputs is not None:
        found.append(("structured_outputs", dict(req.structured_outputs)))
    for name, key in _GUIDED.items():
        value = getattr(req, name)
        if value is not None:
            found.append((name, {key: value}))
    if not found:
        return None
    if len(found) > 1:
        names = [name for name, _ in found]
        raise bad_request(
            f"{' and '.join(names)} both constrain the output; allowed: one of them", names[1]
        )
    param, values = found[0]
    try:
        params = StructuredOutputsParams(**values)
    except TypeError:
        allowed = "json, regex, choice, grammar, json_object"
        raise bad_request(
            f"{param} has unknown fields {sorted(values)}; allowed: one of {allowed}", param
        ) from None
    except ValueError as e:
        raise bad_request(f"{param}: {e}", param) from None
    try:
        _checked(*params.key())
    except ValueError as e:
        raise bad_request(f"{param}: {e}", param) from None
    return params
