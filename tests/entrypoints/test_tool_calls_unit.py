"""Tool calling without a model: the Hermes parser (whole, and streamed in fragments split at
every place, with hypothesis for random splits), malformed output (content, never an error),
the 400s of :func:`plan_tools` and of the message rules, the tool flags, the grammars (what
they accept, by xgrammar's string matcher) and the shipped template (rendered by the default
model's tokenizer)."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from fastdeploy.entrypoints.openai.errors import APIError
from fastdeploy.entrypoints.openai.protocol import ChatCompletionRequest
from fastdeploy.entrypoints.openai.tool_config import ToolServingConfig, tool_serving_config
from fastdeploy.entrypoints.openai.tool_parser import HermesStreamParser, parse_tool_calls
from fastdeploy.entrypoints.openai.tool_request import (
    TemplateChoice,
    hermes_template,
    plan_tools,
    template_messages,
)

NAMES = ("get_weather", "get_time")
CALL_1 = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa}ris", "n": {"a": [1, 2]}}}'
    "\n</tool_call>"
)
CALL_2 = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
OUTPUTS = [
    "Just text, with <b>tags</b> and a < sign.",
    CALL_1,
    "Let me look.\n" + CALL_1,
    CALL_1 + "\n" + CALL_2,
    '<tool_call>{"arguments": {"tz": "UTC"}, "name": "get_time"}</tool_call>',
    '<tool_call>\n{"name": "get_time"}\n</tool_call>',
]
MALFORMED = [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa',  # unclosed (max_tokens)
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>',  # bad JSON
    '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',  # not a tool
    '<tool_call>\n{"name": "get_time", "arguments": "UTC"}\n</tool_call>',  # not an object
    "<tool_call>",
    "text <tool_cal",
]


def stream(text: str, cuts: list[int], parallel: bool = True) -> tuple[str, list[dict]]:
    """Feed ``text`` cut at ``cuts``; returns (content, calls rebuilt from the deltas), checking
    OpenAI's delta rules."""
    parser = HermesStreamParser(NAMES, parallel)
    bounds = [0, *sorted(set(cuts)), len(text)]
    deltas = [parser.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])]
    deltas.append(parser.finish())
    content, calls = "", []
    for d in deltas:
        content += d.content
        for c in d.tool_calls:
            if c["index"] == len(calls):
                assert set(c) == {"index", "id", "type", "function"}
                assert c["id"].startswith("chatcmpl-tool-") and c["type"] == "function"
                assert c["function"]["arguments"] == ""
                calls.append(dict(c["function"]))
            else:
                assert set(c) == {"index", "function"} and set(c["function"]) == {"arguments"}
                assert c["index"] == len(calls) - 1
                calls[-1]["arguments"] += c["function"]["arguments"]
    assert parser.num_calls == len(calls)
    return content, calls


def whole(text: str, parallel: bool = True) -> tuple[str | None, list[dict]]:
    content, calls = parse_tool_calls(text, NAMES, parallel)
    return content, [{"name": c.name, "arguments": json.loads(c.arguments)} for c in calls]


def test_parse_whole_outputs():
    assert whole(OUTPUTS[0]) == (OUTPUTS[0], [])
    args = {"city": "Pa}ris", "n": {"a": [1, 2]}}
    assert whole(CALL_1) == (None, [{"name": "get_weather", "arguments": args}])
    assert whole(OUTPUTS[2]) == ("Let me look.\n", [{"name": "get_weather", "arguments": args}])
    two = whole(OUTPUTS[3])
    assert [c["name"] for c in two[1]] == ["get_weather", "get_time"] and two[0] is None
    assert [c["name"] for c in whole(OUTPUTS[3], parallel=False)[1]] == ["get_weather"]
    assert whole(OUTPUTS[4]) == (None, [{"name": "get_time", "arguments": {"tz": "UTC"}}])
    assert whole(OUTPUTS[5]) == (None, [{"name": "get_time", "arguments": {}}])
    content, calls = parse_tool_calls(CALL_1, NAMES)
    assert calls[0].id.startswith("chatcmpl-tool-") and len(calls[0].id) == 14 + 32
    assert calls[0].to_openai()["function"]["arguments"] == json.dumps(args)


@pytest.mark.parametrize("text", MALFORMED)
def test_malformed_whole_output_is_content(text):
    assert parse_tool_calls(text, NAMES) == (text, [])


@pytest.mark.parametrize("text", OUTPUTS)
def test_stream_split_at_every_place_equals_whole(text):
    want_content, want_calls = whole(text)
    for step in range(1, len(text) + 1):
        cuts = list(range(step, len(text), step))
        content, calls = stream(text, cuts)
        assert content == (want_content or ""), (step, content)
        assert [c["name"] for c in calls] == [c["name"] for c in want_calls], step
        assert [json.loads(c["arguments"]) for c in calls] == [c["arguments"] for c in want_calls]


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(OUTPUTS), st.lists(st.integers(0, 200), max_size=12))
def test_stream_random_splits_equal_whole(text, cuts):
    content, calls = stream(text, [c for c in cuts if c < len(text)])
    want_content, want_calls = whole(text)
    assert content == (want_content or "")
    assert [json.loads(c["arguments"]) for c in calls] == [c["arguments"] for c in want_calls]


def test_stream_fragments_arguments_and_holds_only_a_tag_prefix():
    parser = HermesStreamParser(NAMES)
    assert parser.feed("Sure <tool_").content == "Sure "  # "<tool_" may start a tag
    assert parser.feed("s are fun <").content == "<tool_s are fun "
    d = parser.feed('tool_call>\n{"name": "get_weather", "arguments": {"ci')
    assert d.content == "" and d.tool_calls[0]["function"] == {
        "name": "get_weather",
        "arguments": "",
    }
    assert d.tool_calls[1] == {"index": 0, "function": {"arguments": '{"ci'}}
    d = parser.feed('ty": "Rome"}}\n</tool_')  # the last "}" may close the call: held
    assert d.tool_calls == [{"index": 0, "function": {"arguments": 'ty": "Rome"}'}}]
    assert not parser.feed("call>")
    assert not parser.feed(" trailing text").content  # after a call: dropped, as whole
    assert not parser.finish() and parser.num_calls == 1


@pytest.mark.parametrize("text", MALFORMED)
def test_malformed_stream_never_raises(text):
    for step in (1, 3, len(text)):
        content, calls = stream(text, list(range(step, len(text), step)))
        if calls:  # the name was read before the output broke off: the call stays a call
            assert text.startswith('<tool_call>\n{"name": "get_weather"') and not content
        else:
            assert content == text


def test_stream_not_parallel_keeps_the_first_call():
    content, calls = stream(OUTPUTS[3], [7, 40, 90], parallel=False)
    assert [c["name"] for c in calls] == ["get_weather"] and content == ""


# ------------------------------------------------------------------------------- requests
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
AUTO = ToolServingConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")
ASK = [{"role": "user", "content": "hi"}]


def plan(config=AUTO, **fields):
    return plan_tools(ChatCompletionRequest(messages=ASK, **fields), config)


@pytest.mark.parametrize(
    "fields, config, param, words",
    [
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            AUTO,
            "tool_choice",
            "'x', which is not in tools; allowed: get_weather",
        ),
        ({"tool_choice": "required"}, AUTO, "tool_choice", "needs tools"),
        (
            {"tool_choice": {"type": "function", "function": {"name": "f"}}},
            AUTO,
            "tool_choice",
            "needs tools",
        ),
        (
            {"tools": [WEATHER]},
            ToolServingConfig(),
            "tool_choice",
            '"auto" tool choice requires --enable-auto-tool-choice',
        ),
        (
            {"tools": [WEATHER], "tool_choice": "sometimes"},
            AUTO,
            "tool_choice",
            "allowed: none, auto, required",
        ),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function"}},
            AUTO,
            "tool_choice",
            "is invalid",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "objectx"}},
                    }
                ]
            },
            AUTO,
            "tools",
            "tools[0].function.parameters: json schema is invalid",
        ),
        ({"tools": [WEATHER, WEATHER]}, AUTO, "tools", "used twice"),
        (
            {"tools": [{"type": "function", "function": {"name": "a b"}}]},
            AUTO,
            "tools",
            "tools[0].function.name",
        ),
        ({"tools": [{"type": "retrieval"}]}, AUTO, "tools", "tools[0] is"),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            AUTO,
            "response_format",
            "both constrain",
        ),
    ],
)
def test_plan_refusals_name_the_field(fields, config, param, words):
    with pytest.raises(APIError) as e:
        plan(config, **fields)
    assert e.value.status == 400 and e.value.param == param
    assert words in e.value.message, e.value.message


def test_plan_defaults_and_modes():
    assert plan().choice == "none" and not plan().parses
    p = plan(tools=[WEATHER])
    assert p.choice == "auto" and p.parses and p.parallel and p.grammar is not None
    p = plan(tools=[WEATHER], tool_choice="none")
    assert not p.parses and p.grammar is None and p.tools  # tools are still rendered
    p = plan(
        tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}}
    )
    assert (p.choice, p.name, p.names) == ("named", "get_time", NAMES)
    p = plan(tools=[WEATHER], response_format={"type": "json_object"})
    assert p.parses and p.grammar is None  # auto: the client's constraint wins


def accepts(grammar: str, text: str) -> bool:
    return xgr.testing._is_grammar_accept_string(xgr.Grammar.from_ebnf(grammar), text)


def test_grammars_accept_calls_and_only_calls():
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    other = '<tool_call>\n{"name": "get_time", "arguments": {"tz": 1}}\n</tool_call>'
    required = plan(tools=[WEATHER, TIME], tool_choice="required").grammar.grammar
    assert accepts(required, call) and accepts(required, call + "\n" + other)
    assert not accepts(required, "hello") and not accepts(required, call + " and more")
    assert not accepts(required, call.replace('"Rome"', "5"))  # the schema holds
    single = plan(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    assert accepts(single.grammar.grammar, call) and not accepts(
        single.grammar.grammar, call + "\n" + other
    )
    named = plan(
        tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}}
    )
    assert accepts(named.grammar.grammar, other) and not accepts(named.grammar.grammar, call)
    auto = plan(tools=[WEATHER, TIME]).grammar.grammar
    assert accepts(auto, "Just text.") and accepts(auto, "Let me check. " + call)
    assert not accepts(auto, '<tool_call>\n{"name": "rm", "arguments": {}}\n</tool_call>')
    assert accepts(auto, call + "\n" + other)
    one = plan(tools=[WEATHER, TIME], parallel_tool_calls=False).grammar.grammar
    assert accepts(one, "Let me check. " + call) and not accepts(one, call + "\n" + other)


def test_message_rules_refuse_with_the_field():
    def refused(messages) -> str:
        with pytest.raises(ValidationError) as e:
            ChatCompletionRequest(messages=messages)
        return str(e.value)

    assert "messages[1].tool_call_id is required" in refused(
        [*ASK, {"role": "tool", "content": "x"}]
    )
    assert "messages[1].content is required" in refused(
        [*ASK, {"role": "tool", "tool_call_id": "c"}]
    )
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}
    assert "messages[1].tool_calls[0].function.arguments" in refused(
        [*ASK, {"role": "assistant", "tool_calls": [call]}]
    )
    assert "only allowed on an assistant" in refused(
        [{"role": "user", "content": "x", "tool_calls": []}]
    )
    assert "tool_call_id is only allowed on a tool" in refused(
        [{"role": "user", "content": "x", "tool_call_id": "c"}]
    )
    ok = ChatCompletionRequest(
        messages=[
            *ASK,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{**call, "function": {"name": "f", "arguments": "{}"}}],
            },
            {"role": "tool", "tool_call_id": "c", "content": "42"},
        ]
    )
    msgs = template_messages(ok.messages)
    assert msgs[1]["tool_calls"][0]["function"] == {"name": "f", "arguments": {}}
    assert msgs[2] == {"role": "tool", "content": "42", "tool_call_id": "c"}


def test_tool_flags(tmp_path):
    with pytest.raises(ValueError, match="--tool-call-parser=mistral is invalid; allowed: hermes"):
        tool_serving_config(True, "mistral", None)
    with pytest.raises(ValueError, match="needs --tool-call-parser"):
        tool_serving_config(True, None, None)
    with pytest.raises(ValueError, match="--chat-template=nofile.jinja is invalid"):
        tool_serving_config(False, None, "nofile.jinja")
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    assert tool_serving_config(False, None, str(path)).chat_template == path.read_text()
    assert tool_serving_config(False, "hermes", "{{ x }}").chat_template == "{{ x }}"


@pytest.fixture(scope="module")
def tokenizer():
    from fastdeploy.model_executor.model_loader.source import resolve_model

    return resolve_model(None).load_tokenizer()


def test_template_choice_and_rendering(tokenizer):
    choice = TemplateChoice(tokenizer.chat_template, ToolServingConfig())
    plain = [{"role": "user", "content": "hi"}]
    assert choice.pick(plain, []) is None  # the model's own template
    assert choice.pick(plain, [WEATHER]) == hermes_template()
    assert choice.pick([*plain, {"role": "tool", "content": "x"}], []) == hermes_template()
    assert TemplateChoice("{{ tools }}", ToolServingConfig()).pick(plain, [WEATHER]) is None
    own = TemplateChoice(None, ToolServingConfig(chat_template="{{ 'x' }}"))
    assert own.pick(plain, []) == "{{ 'x' }}"
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Rome and the time?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {
                    "id": "a",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Rome"}},
                },
                {"id": "b", "type": "function", "function": {"name": "get_time", "arguments": {}}},
            ],
        },
        {"role": "tool", "tool_call_id": "a", "content": "20 C"},
        {"role": "tool", "tool_call_id": "b", "content": "noon"},
    ]
    text = tokenizer.apply_chat_template(
        messages,
        tools=[WEATHER, TIME],
        chat_template=hermes_template(),
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(WEATHER) + "\n" + json.dumps(TIME) + "\n</tools>" in text
    assert (
        "<|im_start|>assistant\nChecking.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n<tool_call>\n'
        '{"name": "get_time", "arguments": {}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n20 C\n</tool_response>\n<tool_response>\nnoon\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    ) in text
    # What the parser reads back from a rendered call is the call.
    start = text.index("Checking.\n") + len("Checking.\n")
    rendered_call = text[start : text.index("<|im_end|>\n<|im_start|>user\n<tool")]
    _, calls = parse_tool_calls(rendered_call, NAMES)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Rome"}),
        ("get_time", {}),
    ]


def test_delta_parts_one_entry_per_call_a_chunk():
    parser = HermesStreamParser(NAMES)
    step = parser.feed('Hi<tool_call>\n{"name": "get_time", "arguments": {"tz"')
    step.tool_calls += parser.feed(': "UTC"').tool_calls
    (first, first_calls), (second, second_calls) = step.parts()
    assert first == "Hi" and [set(c) for c in first_calls] == [{"index", "id", "type", "function"}]
    assert second == "" and second_calls == [
        {"index": 0, "function": {"arguments": '{"tz": "UTC"'}}
    ]


def test_server_flags_checked_at_start_up():
    from fastdeploy.entrypoints.server_args import check_server_args, make_arg_parser, tool_config

    parser = make_arg_parser()
    with pytest.raises(ValueError, match="--tool-call-parser=pythonic is invalid; allowed: hermes"):
        check_server_args(parser.parse_args(["--tool-call-parser", "pythonic"]))
    args = parser.parse_args(["--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    check_server_args(args)
    assert tool_config(args) == ToolServingConfig(True, "hermes", None)
    assert tool_config(parser.parse_args([])) == ToolServingConfig()


def test_a_cut_last_call_keeps_the_whole_ones_whole_and_streamed():
    """An output cut by max_tokens inside its third call: the two whole calls come back, the
    same two a stream of that output completes (a required answer with parallel calls)."""
    text = CALL_1 + "\n" + CALL_2 + '\n<tool_call>\n{"name": "get_weather", "arguments": {"ci'
    content, calls = parse_tool_calls(text, NAMES)
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Pa}ris", "n": {"a": [1, 2]}}),
        ("get_time", {}),
    ]
    _, streamed = stream(text, [])
    whole = [c for c in streamed if c["arguments"].endswith("}")]
    assert [(c["name"], json.loads(c["arguments"])) for c in whole[:2]] == [
        (c.name, json.loads(c.arguments)) for c in calls
    ]
