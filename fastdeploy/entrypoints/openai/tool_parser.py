"""Hermes tool calls in a model's output -> OpenAI ``tool_calls``, whole or streamed.

Format (Hermes 2 Pro, Qwen2.5, SmolLM2; what :mod:`~fastdeploy.entrypoints.openai.tool_request`
constrains and the shipped template renders)::

    optional text<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Rules (facts from vLLM v0.11's hermes parser and OpenAI's stream, our own code):

* ``content`` is the text before the first ``<tool_call>`` (None when blank); text between or
  after calls is dropped.
* A call is a closed tag whose JSON is an object with a ``name`` among the request's tools and
  an object as ``arguments`` (missing: ``{}``). If any tag is malformed (bad JSON, unknown name,
  unclosed with no whole call before it), :func:`parse_tool_calls` returns the whole output as
  content, no calls: the client gets what the model wrote, never an error. An unclosed tag after
  whole calls (cut by ``max_tokens``) is dropped and the whole calls kept, as streamed.
* Ids are ``chatcmpl-tool-<32 hex>``; ``arguments`` is a JSON string.
* Streamed (:class:`HermesStreamParser`): text before a call streams as content, holding back
  only a tail that may be the start of ``<tool_call>``; a call's first delta carries
  ``index``, ``id``, ``type``, ``function.name`` and ``arguments: ""`` once its name and the
  ``{`` of its arguments are read;
  later deltas carry ``function.arguments`` fragments (the model's own text of the arguments,
  which concatenate to valid JSON when the call closes). A tag whose name never parses is
  flushed as content when the output ends.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastdeploy.entrypoints.openai.tool_request import CALL_BEGIN, CALL_END

#: Up to the start of the arguments' value: ``{"name": "<name>", "arguments": ``.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')

#: What may follow the arguments' value inside a call: the object's ``}`` and blanks.
_TAIL = re.compile(r"\s*\}\s*$")


def new_call_id() -> str:
    """``chatcmpl-tool-<32 hex>`` (vLLM's form of a tool call id)."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ParsedCall:
    name: str
    arguments: str  #: JSON text
    id: str = field(default_factory=new_call_id)

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def _call_of(body: str, names: tuple[str, ...]) -> ParsedCall | None:
    """The call in one tag's body, or None when it is not a call of one of ``names``."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", {})
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


def parse_tool_calls(
    text: str, names: tuple[str, ...], parallel: bool = True
) -> tuple[str | None, list[ParsedCall]]:
    """``(content, calls)`` of a whole output. Without ``parallel`` only the first call is kept.

    A malformed output (see the module docstring) gives ``(text, [])``; an unclosed call after
    whole ones (an output cut by ``max_tokens``) is dropped and the whole calls are kept, as the
    stream sent them.
    """
    start = text.find(CALL_BEGIN)
    if start < 0:
        return text, []
    calls, pos = [], start
    while pos >= 0:
        end = text.find(CALL_END, pos)
        if end < 0:
            if calls:  # the last call was cut (max_tokens): the whole ones stand, as streamed
                break
            return text, []
        call = _call_of(text[pos + len(CALL_BEGIN) : end], names)
        if call is None:
            return text, []
        calls.append(call)
        pos = text.find(CALL_BEGIN, end)
    content = text[:start]
    if not parallel:
        calls = calls[:1]
    return (content if content.strip() else None), calls


def _held_tail(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


@dataclass
class StreamDelta:
    """What one step adds: ``content`` text, and tool call deltas in OpenAI's streamed form
    (``{"index", "id", "type", "function": {"name", "arguments": ""}}`` first, then
    ``{"index", "function": {"arguments": fragment}}``)."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)

    def parts(self) -> list[tuple[str, list[dict[str, Any]]]]:
        """``(content, tool_calls)`` of the chunks this delta is sent as: consecutive argument
        fragments of a call are joined, and a call's first delta never shares a chunk with its
        fragments (as OpenAI streams: one entry per call index in a chunk). The content goes
        with the first chunk."""
        parts: list[tuple[str, list[dict[str, Any]]]] = [(self.content, [])]
        for call in self.tool_calls:
            calls = parts[-1][1]
            last = calls[-1] if calls else None
            if last is not None and last["index"] == call["index"]:
                if "id" in last or "id" in call:
                    parts.append(("", [dict(call)]))
                    continue
                last["function"] = {
                    "arguments": last["function"]["arguments"] + call["function"]["arguments"]
                }
                continue
            calls.append(dict(call))
        return parts


class HermesStreamParser:
    """Streams one choice's output as content and tool call deltas (module docstring).

    Feed each step's new text to :meth:`feed`, then call :meth:`finish` once at the end;
    :attr:`num_calls` tells whether the choice made calls (its finish reason then is
    ``tool_calls``).
    """

    def __init__(self, names: tuple[str, ...], parallel: bool = True) -> None:
        self.names = names
        self.parallel = parallel
        self.num_calls = 0
        self._buf = ""  # text not yet streamed (text state) or the open tag's body (call state)
        self._in_call = False
        self._named = False  # the open call's first delta was sent
        self._sent_args = 0  # characters of the open call's arguments streamed
        self._done = False  # no more calls accepted (not parallel, one made)
        self._after_call = False  # text after a call is dropped, as parse_tool_calls does

    def feed(self, text: str) -> StreamDelta:
        """The delta of ``text`` (the step's new output text)."""
        out = StreamDelta()
        self._buf += text
        while True:
            if not self._in_call:
                start = self._buf.find(CALL_BEGIN)
                if start < 0:
                    keep = _held_tail(self._buf, CALL_BEGIN)
                    self._emit_text(out, self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    return out
                self._emit_text(out, self._buf[:start])
                self._buf = self._buf[start + len(CALL_BEGIN) :]
                self._in_call, self._named, self._sent_args = True, False, 0
                continue
            end = self._buf.find(CALL_END)
            body = self._buf if end < 0 else self._buf[:end]
            self._stream_call(out, body, closed=end >= 0)
            if end < 0:
                return out
            self._buf = self._buf[end + len(CALL_END) :]
            self._in_call = False

    def finish(self) -> StreamDelta:
        """Flush at the end of the output: held text goes out as content; an open tag whose
        call never started streaming goes out as content with its tag."""
        out = StreamDelta()
        if self._in_call and not self._named:
            self._emit_text(out, CALL_BEGIN + self._buf)
        elif not self._in_call:
            self._emit_text(out, self._buf)
        self._buf, self._in_call = "", False
        return out

    def _emit_text(self, out: StreamDelta, text: str) -> None:
        if self._after_call:  # text after a call is dropped, as parse_tool_calls does
            return
        out.content += text

    def _start_call(self, out: StreamDelta, name: str) -> None:
        """The first delta of a call: index, id, type, name and empty arguments."""
        self._named = True
        out.tool_calls.append(
            {
                "index": self.num_calls,
                "id": new_call_id(),
                "type": "function",
                "function": {"name": name, "arguments": ""},
            }
        )
        self.num_calls += 1
        self._after_call = True
        if not self.parallel:
            self._done = True

    def _stream_call(self, out: StreamDelta, body: str, closed: bool) -> None:
        if not self._named:
            head = _HEAD.match(body)
            name = json.loads(f'"{head.group(1)}"') if head else None
            whole = _call_of(body, self.names) if closed and head is None else None
            if whole is not None and not self._done:  # a call in another key order: at once
                self._start_call(out, whole.name)
                out.tool_calls.append(
                    {"index": self.num_calls - 1, "function": {"arguments": whole.arguments}}
                )
                return
            value = body[head.end() :].lstrip() if head else ""
            if head is None or name not in self.names or self._done or value[:1] != "{":
                if closed:  # never a call: its text goes out as content (unless after one)
                    self._emit_text(out, CALL_BEGIN + body + CALL_END)
                return
            self._start_call(out, name)
            self._args_at = head.end()
        args = body[self._args_at :]
        if self._sent_args == 0:  # the blanks before the arguments' value are not theirs
            lead = len(args) - len(args.lstrip())
            if lead == len(args):
                return
            self._args_at += lead
            args = args[lead:]
        if closed:
            tail = _TAIL.search(args)
            upto = tail.start() if tail else len(args)
        else:  # hold back what may be the closing "}", blanks and the start of </tool_call>
            held = _held_tail(args, CALL_END)
            rest = args[: len(args) - held]
            tail = re.search(r"\s*(\}\s*)?$", rest)
            upto = tail.start() if tail else len(rest)
        if upto > self._sent_args:
            out.tool_calls.append(
                {
                    "index": self.num_calls - 1,
                    "function": {"arguments": args[self._sent_args : upto]},
                }
            )
            self._sent_args = upto
