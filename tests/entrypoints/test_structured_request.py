"""Structured-output request forms without a model: StructuredOutputsParams, the spec check
(xgrammar, tokenizer-free), and the server's mapping of OpenAI / vLLM fields with its 400s."""

from __future__ import annotations

import json

import pytest

from fastdeploy.core.sampling_params import SamplingParams
from fastdeploy.core.structured_output import StructuredOutputsParams, check_grammar
from fastdeploy.entrypoints.openai.errors import APIError
from fastdeploy.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from fastdeploy.entrypoints.openai.structured_request import structured_outputs_from

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"enum": ["x", "y"]}}}
MSGS = [{"role": "user", "content": "hi"}]


def test_key_keeps_the_schema_key_order_and_builds_choice_ebnf():
    assert StructuredOutputsParams(json=SCHEMA).key() == (
        "json",
        json.dumps(SCHEMA, separators=(",", ":")),
    )
    assert StructuredOutputsParams(json=json.dumps(SCHEMA)).key()[1].index('"b"') < 40
    kind, spec = StructuredOutputsParams(choice=["yes", 'say "no"']).key()
    assert (kind, spec) == ("grammar", 'root ::= "yes" | "say \\"no\\""')
    check_grammar(kind, spec)  # the EBNF parses
    assert StructuredOutputsParams(json_object=True).key() == ("json_object", "")
    assert StructuredOutputsParams(regex=r"\d+").key() == ("regex", r"\d+")


@pytest.mark.parametrize(
    "values, words",
    [
        ({}, "sets nothing"),
        ({"regex": "a", "choice": ["b"]}, "sets ['regex', 'choice']"),
        ({"choice": []}, "non-empty list"),
        ({"choice": ["a", 1]}, "non-empty list"),
        ({"regex": ""}, "non-empty string"),
        ({"json": 3}, "JSON schema"),
    ],
)
def test_bad_params_are_refused_naming_the_problem(values, words):
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        StructuredOutputsParams(**values)


@pytest.mark.parametrize(
    "kind, spec, words",
    [
        ("json", '{"type": "objectx"}', 'json schema is invalid: Unsupported type "objectx"'),
        ("json", "{not json", "json schema is not valid JSON"),
        ("json", "[1]", "allowed: a JSON object"),
        ("regex", "a(b", "regex is invalid: Regex parsing error at position 4"),
        ("grammar", 'root ::= "a', "grammar is invalid: EBNF lexer error"),
        ("xml", "", "grammar kind 'xml' is invalid"),
    ],
)
def test_check_grammar_names_xgrammars_reason(kind, spec, words):
    with pytest.raises(ValueError) as e:
        check_grammar(kind, spec)
    assert words in str(e.value) and "/project/" not in str(e.value)


def test_sampling_params_takes_the_params_or_a_dict():
    p = SamplingParams(structured_outputs={"regex": "ab"})
    assert p.structured_outputs == StructuredOutputsParams(regex="ab")
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs="ab")


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=MSGS, **fields)


@pytest.mark.parametrize(
    "fields, want",
    [
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "n", "schema": SCHEMA, "strict": True},
                }
            },
            StructuredOutputsParams(json=SCHEMA),
        ),  # fmt: skip
        (
            {"structured_outputs": {"choice": ["a", "b"]}},
            StructuredOutputsParams(choice=("a", "b")),
        ),
        ({"guided_json": SCHEMA}, StructuredOutputsParams(json=SCHEMA)),
        ({"guided_regex": "[ab]+"}, StructuredOutputsParams(regex="[ab]+")),
        ({"guided_choice": ["x"]}, StructuredOutputsParams(choice=("x",))),
        ({"guided_grammar": 'root ::= "z"'}, StructuredOutputsParams(grammar='root ::= "z"')),
    ],
)
def test_request_forms_map_to_one_constraint(fields, want):
    assert structured_outputs_from(chat(**fields)) == want
    completion = CompletionRequest(prompt="p", **fields)
    assert structured_outputs_from(completion) == want


@pytest.mark.parametrize(
    "fields, param, words",
    [
        ({"guided_json": {"type": "objectx"}}, "guided_json", 'Unsupported type "objectx"'),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "n"}}},
            "response_format",
            "needs",
        ),
        ({"response_format": {"type": "json_object", "x": 1}}, "response_format", "unknown"),
        ({"structured_outputs": {"regexp": "a"}}, "structured_outputs", "unknown fields"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "both constrain"),
        ({"guided_grammar": "root ::= "}, "guided_grammar", "grammar is invalid"),
    ],
)
def test_bad_forms_are_400s_naming_the_field(fields, param, words):
    with pytest.raises(APIError) as e:
        structured_outputs_from(chat(**fields))
    assert e.value.status == 400 and e.value.param == param
    assert words in e.value.message


def test_unknown_response_format_type_is_refused_by_the_model():
    with pytest.raises(ValueError, match="response_format type 'xml' is not supported"):
        chat(response_format={"type": "xml"})
