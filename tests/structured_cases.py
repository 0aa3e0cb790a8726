"""Structured-output cases shared by the engine tests on CPU
(``tests/engine/test_structured_output_engine.py``) and on CUDA
(``tests/gpu/test_structured_output_gpu.py``): a schema with an enum and a bounded array, a
regex, four chat prompts, and a batch mixing a schema row, a regex row and two plain rows."""

from __future__ import annotations

from fastdeploy import SamplingParams
from fastdeploy.core.structured_output import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "kind": {"enum": ["capital", "town"]},
        "rivers": {"type": "array", "items": {"type": "string", "maxLength": 15}, "maxItems": 2},
    },
    "required": ["city", "kind", "rivers"],
}
REGEX = r"(Paris|Rome|Berlin)\."
ASK = [[{"role": "user", "content": q}] for q in (
    "Describe the capital of France as JSON.",
    "What is the capital of Italy? One word.",
    "What is the capital of France?",
    "Name a colour.",
)]  # fmt: skip


def params(so: StructuredOutputsParams | None) -> SamplingParams:
    """Greedy, up to 80 tokens, under ``so`` (None: unconstrained)."""
    return SamplingParams(temperature=0, max_tokens=80, structured_outputs=so)


MIXED = [params(StructuredOutputsParams(json=SCHEMA)), params(StructuredOutputsParams(regex=REGEX)),
         params(None), params(None)]  # fmt: skip
