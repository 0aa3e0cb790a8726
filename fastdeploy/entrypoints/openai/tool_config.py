"""The server's tool flags (vLLM's names): ``--enable-auto-tool-choice``,
``--tool-call-parser`` and ``--chat-template``, as one :class:`ToolServingConfig`.

Light on purpose (no web stack, no xgrammar): ``--print-config`` and start-up checks import it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

#: Values of ``--tool-call-parser`` (vLLM's flag; vLLM has more, for other model families).
TOOL_CALL_PARSERS = ("hermes",)


@dataclass(frozen=True)
class ToolServingConfig:
    """The server's tool flags (vLLM's names).

    Attributes:
        enable_auto_tool_choice: ``--enable-auto-tool-choice``: ``tool_choice: auto`` (the
            default when a request has tools) is served; without it such a request is a 400.
        tool_call_parser: ``--tool-call-parser``, one of :data:`TOOL_CALL_PARSERS` or None.
        chat_template: ``--chat-template``'s text (read from the file), or None: the model's.
    """

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    chat_template: str | None = None


def tool_serving_config(
    enable_auto_tool_choice: bool, tool_call_parser: str | None, chat_template: str | None
) -> ToolServingConfig:
    """The config of the server's flags; ``chat_template`` is a path or an inline template.

    Raises:
        ValueError: an unknown parser (naming the allowed ones), auto tool choice without a
            parser (vLLM's rule), or a ``--chat-template`` that is neither a readable file nor
            a Jinja template.
    """
    if tool_call_parser is not None and tool_call_parser not in TOOL_CALL_PARSERS:
        raise ValueError(
            f"--tool-call-parser={tool_call_parser} is invalid; allowed: "
            + ", ".join(TOOL_CALL_PARSERS)
        )
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError(
            "--enable-auto-tool-choice needs --tool-call-parser; allowed: "
            + ", ".join(TOOL_CALL_PARSERS)
        )
    text = None
    if chat_template is not None:
        if os.path.isfile(chat_template):
            with open(chat_template, encoding="utf-8") as f:
                text = f.read()
        elif "{{" in chat_template or "{%" in chat_template:
            text = chat_template
        else:
            raise ValueError(
                f"--chat-template={chat_template} is invalid: no such file, and not a Jinja "
                "template; allowed: a template file's path or the template itself"
            )
    return ToolServingConfig(enable_auto_tool_choice, tool_call_parser, text)
