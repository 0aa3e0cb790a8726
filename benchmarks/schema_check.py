"""``benchmark_serving.py --json-schema``: load the schema, put it on each request, judge outputs.

The request field is OpenAI's ``response_format`` (``{"type": "json_schema", "json_schema":
{"name": "bench", "schema": ..., "strict": true}}``), which this server, vLLM and SGLang accept
on ``/v1/completions`` as well as on chat. Outputs are judged with ``jsonschema`` (in the
project's ``test`` extra) where it is installed; without it only ``json.loads`` is checked, and
:attr:`SchemaChecker.method` says so in the table and the ``--json`` output.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: ``benchmarks/bench_schema.json``: the example schema of docs/benchmarks.md (a nested object,
#: an enum and an array, every string bounded so a greedy output ends well inside 128 tokens)
DEFAULT_SCHEMA = Path(__file__).resolve().parent / "bench_schema.json"


def load_json_schema(value: str) -> dict[str, Any]:
    """The schema ``value`` names: inline JSON when it starts with ``{``, else a file's path.

    Raises:
        SystemExit: the file is missing, the text is not JSON, or the JSON is not an object (the
            message quotes the value and says what is allowed).
    """
    text = value.strip()
    where = "inline --json-schema"
    if not text.startswith("{"):
        path = Path(value)
        if not path.is_file():
            raise SystemExit(
                f"--json-schema={value!r} is neither inline JSON (starting with '{{') nor a file"
            )
        text, where = path.read_text(), f"--json-schema file {value}"
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise SystemExit(f"{where} is not JSON: {e}") from None
    if not isinstance(schema, dict):
        raise SystemExit(f"{where} must be a JSON object (a schema); got {type(schema).__name__}")
    return schema


def request_fields(schema: dict[str, Any] | None) -> dict[str, Any]:
    """The body fields that constrain a request to ``schema`` ({} without one)."""
    if schema is None:
        return {}
    spec = {"name": "bench", "schema": schema, "strict": True}
    return {"response_format": {"type": "json_schema", "json_schema": spec}}


class SchemaChecker:
    """Judges output texts against one schema.

    ``method`` is ``"jsonschema"`` (Draft 2020-12 or the schema's ``$schema`` draft, via
    ``jsonschema.validators.validator_for``) or ``"json.loads only"`` when ``jsonschema`` is not
    installed.

    Raises:
        SystemExit: from the constructor, when ``jsonschema`` finds the schema itself invalid.
    """

    def __init__(self, schema: dict[str, Any]) -> None:
        try:
            import jsonschema
        except ImportError:
            self.validator, self.method = None, "json.loads only"
            return
        cls = jsonschema.validators.validator_for(schema)
        try:
            cls.check_schema(schema)
        except jsonschema.SchemaError as e:
            raise SystemExit(f"--json-schema is not a valid JSON schema: {e.message}") from None
        self.validator, self.method = cls(schema), "jsonschema"

    def valid(self, text: str) -> bool:
        """Whether ``text`` is one JSON value (surrounding whitespace allowed) the schema
        accepts."""
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return False
        return self.validator is None or self.validator.is_valid(value)
