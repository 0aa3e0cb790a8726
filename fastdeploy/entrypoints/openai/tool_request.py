"""A chat request's tool fields -> one checked :class:`ToolPlan`: the tools, what the client
chose (``tool_choice``, ``parallel_tool_calls``), the grammar that enforces it, and the chat
template that renders them (docs/tool-calling.md).

* ``tool_choice`` ``required`` and a named function are enforced: the output is constrained to
  Hermes ``<tool_call>`` blocks whose JSON is ``{"name": <a tool>, "arguments": <its
  parameters schema>}`` (one block, or one or more separated by a newline when
  ``parallel_tool_calls`` is true for ``required``), so it always parses.
* ``auto`` (needs ``--enable-auto-tool-choice``, as in vLLM) leaves text free and constrains
  only what follows a ``<tool_call>`` the model starts (xgrammar's triggered structural tag).
* ``none`` renders the tools (vLLM's default) and parses nothing.

The grammars are xgrammar structural tags (xgrammar 0.2.x, ``Grammar.from_structural_tag``:
``tag``, ``tags_with_separator``, ``triggered_tags``), printed as EBNF so that they cross the
process line and hit the engine's compile cache as any ``grammar`` constraint does.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from typing import Any

from fastdeploy.core.structured_output import StructuredOutputsParams, check_grammar
from fastdeploy.entrypoints.openai.errors import bad_request
from fastdeploy.entrypoints.openai.tool_config import ToolServingConfig

logger = logging.getLogger("fastdeploy.api_server")

#: ``tool_choice`` strings (OpenAI's); the fourth form is ``{"type": "function", "function":
#: {"name": ...}}``.
TOOL_CHOICES = ("none", "auto", "required")

#: OpenAI's rule on function names.
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

#: The shipped template (ChatML + Hermes tool calls), used for a request with tools or tool
#: history when the model's own template does not mention ``tools``.
HERMES_TEMPLATE_FILE = "tool_chat_template_hermes.jinja"

#: What the tag of one call starts and ends with; the JSON between is ``{"name": ...,
#: "arguments": ...}`` (Hermes 2 Pro / Qwen2.5 / SmolLM2's format).
CALL_BEGIN, CALL_END = "<tool_call>", "</tool_call>"


@lru_cache(maxsize=1)
def hermes_template() -> str:
    """The text of the shipped Hermes tool template."""
    return resources.files(__package__).joinpath(HERMES_TEMPLATE_FILE).read_text("utf-8")


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request asked of tools.

    Attributes:
        tools: the request's tools (OpenAI's ``{"type": "function", "function": {...}}``).
        choice: ``none``, ``auto``, ``required`` or ``named``.
        name: the function of a named choice.
        parallel: ``parallel_tool_calls`` (default true).
        grammar: the constraint enforcing the choice, or None.
    """

    tools: list[dict[str, Any]] = field(default_factory=list)
    choice: str = "none"
    name: str | None = None
    parallel: bool = True
    grammar: StructuredOutputsParams | None = None

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t["function"]["name"] for t in self.tools)

    @property
    def parses(self) -> bool:
        """Whether the output is parsed for tool calls (every choice but ``none``)."""
        return self.choice != "none" and bool(self.tools)


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """The tools, each ``{"type": "function", "function": {"name", "description"?,
    "parameters"?, "strict"?}}``, names unique, parameters a schema xgrammar converts.

    Raises:
        APIError: 400 on ``tools``, naming the tool's index, the field and what is allowed.
    """
    if not isinstance(tools, list):
        raise bad_request("tools is not a list; allowed: a list of function tools", "tools")
    seen: set[str] = set()
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        shape = '{"type": "function", "function": {"name": ..., "parameters": {...}}}'
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise bad_request(f"{where} is {json.dumps(tool)[:200]}; allowed: {shape}", "tools")
        if set(tool) - {"type", "function"}:
            extra = sorted(set(tool) - {"type", "function"})
            raise bad_request(f"{where} has unknown fields {extra}; allowed: {shape}", "tools")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise bad_request(f"{where}.function is missing; allowed: {shape}", "tools")
        extra = sorted(set(fn) - {"name", "description", "parameters", "strict"})
        if extra:
            raise bad_request(
                f"{where}.function has unknown fields {extra}; allowed: name, description, "
                "parameters, strict",
                "tools",
            )
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise bad_request(
                f"{where}.function.name={json.dumps(name)} is invalid; allowed: 1 to 64 of "
                "a-z, A-Z, 0-9, _ and -",
                "tools",
            )
        if name in seen:
            raise bad_request(
                f"{where}.function.name={name!r} is used twice; allowed: unique names", "tools"
            )
        seen.add(name)
        if "description" in fn and not isinstance(fn["description"], str):
            raise bad_request(f"{where}.function.description is not a string", "tools")
        params = fn.get("parameters")
        if params is not None:
            if not isinstance(params, dict):
                raise bad_request(
                    f"{where}.function.parameters is {json.dumps(params)[:200]}; allowed: a "
                    "JSON schema object",
                    "tools",
                )
            try:
                _checked_schema(json.dumps(params, separators=(",", ":")))
            except ValueError as e:
                raise bad_request(f"{where}.function.parameters: {e}", "tools") from None
        out.append({"type": "function", "function": fn})
    return out


@lru_cache(maxsize=256)
def _checked_schema(spec: str) -> None:
    check_grammar("json", spec)


def _arguments_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool's ``parameters``, or any object when it has none."""
    return tool["function"].get("parameters") or {"type": "object"}


def _call_tag(tool: dict[str, Any]) -> dict[str, Any]:
    """The structural tag of one call of ``tool``: the begin string fixes the name, the
    content is the arguments' schema."""
    name = tool["function"]["name"]
    return {
        "type": "tag",
        "begin": f'{CALL_BEGIN}\n{{"name": {json.dumps(name)}, "arguments": ',
        "content": {"type": "json_schema", "json_schema": _arguments_schema(tool)},
        "end": f"}}\n{CALL_END}",
    }


def call_grammar(tools: list[dict[str, Any]], choice: str, parallel: bool) -> str:
    """EBNF text of the grammar enforcing ``choice`` over ``tools``.

    ``required``/``named`` (``tools`` holding the one named tool): a call block, or with
    ``parallel`` one or more separated by ``"\\n"``, nothing else. ``auto``: any text; a
    ``<tool_call>`` the model writes must go on as a whole call of one of ``tools``; without
    ``parallel`` the output ends after that call (xgrammar's ``stop_after_first``).

    Raises:
        ValueError: xgrammar refuses the tag (a schema it cannot convert).
    """
    import xgrammar as xgr

    tags = [_call_tag(t) for t in tools]
    if choice == "auto":
        fmt = {
            "type": "triggered_tags",
            "triggers": [CALL_BEGIN],
            "tags": tags,
            "at_least_one": False,
            "stop_after_first": not parallel,
        }
    elif parallel:
        fmt = {
            "type": "tags_with_separator",
            "separator": "\n",
            "tags": tags,
            "at_least_one": True,
            "stop_after_first": False,
        }
    else:
        fmt = tags[0] if len(tags) == 1 else {"type": "or", "elements": tags}
    try:
        grammar = xgr.Grammar.from_structural_tag(
            json.dumps({"type": "structural_tag", "format": fmt})
        )
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"the tools' grammar is invalid: {e}") from None
    return str(grammar)


_call_grammar_cached = lru_cache(maxsize=128)(
    lambda tools_json, choice, parallel: call_grammar(json.loads(tools_json), choice, parallel)
)


def plan_tools(req: Any, config: ToolServingConfig) -> ToolPlan:
    """Check a chat request's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` and plan
    them (vLLM's defaults: ``auto`` when there are tools, else ``none``).

    Raises:
        APIError: 400 naming the field: a malformed tool or one whose parameters are not a
            schema; an unknown ``tool_choice``; a named function not in ``tools``; ``required``
            or a named function without tools; ``auto`` without ``--enable-auto-tool-choice``
            (vLLM's message); ``required`` or a named function together with another output
            constraint (``response_format`` and co).
    """
    tools = check_tools(req.tools) if req.tools else []
    choice, name = req.tool_choice, None
    if choice is None:
        choice = "auto" if tools else "none"
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if (
            choice.get("type") != "function"
            or not isinstance(name, str)
            or set(choice)
            - {
                "type",
                "function",
            }
        ):
            raise bad_request(
                f"tool_choice={json.dumps(choice)[:200]} is invalid; allowed: none, auto, "
                'required or {"type": "function", "function": {"name": ...}}',
                "tool_choice",
            )
        choice = "named"
    elif choice not in TOOL_CHOICES:
        raise bad_request(
            f"tool_choice={json.dumps(choice)} is invalid; allowed: none, auto, required or "
            '{"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    names = [t["function"]["name"] for t in tools]
    if choice in ("required", "named") and not tools:
        shown = "required" if choice == "required" else f"function {name!r}"
        raise bad_request(
            f"tool_choice {shown} needs tools, and the request has none; allowed: tools with "
            "at least one function, or tool_choice none",
            "tool_choice",
        )
    if choice == "named" and name not in names:
        raise bad_request(
            f"tool_choice names the function {name!r}, which is not in tools; allowed: "
            + ", ".join(names),
            "tool_choice",
        )
    if choice == "auto" and tools and not config.enable_auto_tool_choice:
        raise bad_request(
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to '
            "be set (tool_choice is auto by default when tools are sent); allowed here: "
            'tool_choice "none", "required" or a named function',
            "tool_choice",
        )
    parallel = True if req.parallel_tool_calls is None else req.parallel_tool_calls
    plan = ToolPlan(tools, choice, name, parallel)
    if not plan.parses:
        return plan
    constrained = [
        n
        for n in ("response_format", "structured_outputs", "guided_json", "guided_regex")
        + ("guided_choice", "guided_grammar")
        if getattr(req, n, None) is not None
        and not (n == "response_format" and req.response_format.get("type") == "text")
    ]
    if constrained:
        if choice == "auto":  # the client's constraint wins; calls are parsed if they appear
            return plan
        raise bad_request(
            f"tool_choice {choice} and {constrained[0]} both constrain the output; allowed: "
            "one of them",
            constrained[0],
        )
    chosen = [t for t in tools if t["function"]["name"] == name] if name else tools
    try:
        ebnf = _call_grammar_cached(
            json.dumps(chosen, sort_keys=True),
            "auto" if choice == "auto" else "required",
            parallel and choice != "named",
        )
    except ValueError as e:
        raise bad_request(str(e), "tools") from None
    return ToolPlan(tools, choice, name, parallel, StructuredOutputsParams(grammar=ebnf))


def needs_tool_template(messages: list[dict[str, Any]], tools: list[Any]) -> bool:
    """Whether a conversation needs a template that knows tools: it has tools, an assistant
    message with ``tool_calls`` or a ``tool`` message."""
    return bool(tools) or any(m.get("tool_calls") or m["role"] == "tool" for m in messages)


def template_mentions_tools(template: str | None) -> bool:
    """Whether a chat template reads the ``tools`` variable (a crude, safe test: the word)."""
    return template is not None and re.search(r"\btools\b", template) is not None


def template_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """Chat messages as the template reads them: ``developer`` as ``system``, text parts
    joined, ``tool_calls`` with their ``arguments`` parsed to an object when they are JSON
    (transformers' convention; a template then writes them with ``tojson``), else left as the
    string, and ``tool_call_id`` kept."""
    out = []
    for m in messages:
        d: dict[str, Any] = {
            "role": "system" if m.role == "developer" else m.role,
            "content": m.text(),
        }
        if m.tool_calls:
            calls = []
            for c in m.tool_calls:
                try:
                    args: Any = json.loads(c.function.arguments)
                except json.JSONDecodeError:
                    args = c.function.arguments
                calls.append(
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.function.name, "arguments": args},
                    }
                )
            d["tool_calls"] = calls
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            d["name"] = m.name
        out.append(d)
    return out


class TemplateChoice:
    """Which chat template renders a conversation: ``--chat-template`` when given, else the
    model's, except that a conversation with tools or tool history gets the shipped Hermes
    template when the model's does not mention ``tools``. Logs each choice once."""

    def __init__(self, model_template: str | None, config: ToolServingConfig) -> None:
        self.model_template = model_template
        self.config = config
        self._logged: set[str] = set()

    def pick(self, conversation: list[dict[str, Any]], tools: list[Any]) -> str | None:
        """The template text to pass to ``apply_chat_template`` (None: the tokenizer's)."""
        if self.config.chat_template is not None:
            self._log("--chat-template", "the template of --chat-template")
            return self.config.chat_template
        if needs_tool_template(conversation, tools) and not template_mentions_tools(
            self.model_template
        ):
            self._log(
                "hermes",
                f"the shipped Hermes tool template ({HERMES_TEMPLATE_FILE}) for requests with "
                "tools or tool messages: the model's template does not render tools",
            )
            return hermes_template()
        return None

    def _log(self, key: str, what: str) -> None:
        if key not in self._logged:
            self._logged.add(key)
            logger.info("chat template: %s", what)
