"""The command line of the OpenAI-compatible server: :func:`make_arg_parser` (the server's flags
and every :class:`~fastdeploy.engine.args_utils.EngineArgs` field), shared by ``fastdeploy serve``
and ``python -m fastdeploy.entrypoints.openai.api_server``, and the rules on the server's own
flags (:data:`SERVER_FLAG_RULES`, checked by :func:`check_server_args`), kept beside the flags they
judge. Start-up (:mod:`fastdeploy.entrypoints.launch`) checks them before anything is loaded.

Imports neither the web stack nor the model code (``--print-config`` and ``--help`` stay fast).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

from fastdeploy import envs
from fastdeploy.core.sampling_params import DEFAULT_STOP_LIMITS, MAX_STOP_LIMITS, StopLimits
from fastdeploy.engine.args_utils import EngineArgs
from fastdeploy.entrypoints.engine_client.stall_watch import (
    DEFAULT_ENGINE_STALL_TIMEOUT_S,
    check_stall_timeout,
)
from fastdeploy.entrypoints.openai.auth import mask
from fastdeploy.entrypoints.openai.limits import HTTPLimits
from fastdeploy.entrypoints.openai.tool_config import (
    TOOL_CALL_PARSERS,
    ToolServingConfig,
    tool_serving_config,
)

#: Name served when ``--model`` is not given (the bundled default model).
DEFAULT_SERVED_MODEL_NAME = "SmolLM2-135M-Instruct"


def make_arg_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Add the server flags and every ``EngineArgs`` field (``--kebab-case``) to ``parser``
    (a new one when None); returns it.

    Shared by ``fastdeploy serve`` and ``python -m fastdeploy.entrypoints.openai.api_server``.
    """
    if parser is None:
        parser = argparse.ArgumentParser(
            prog="python -m fastdeploy.entrypoints.openai.api_server",
            description="FastDeploy OpenAI-compatible server",
        )
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = env_help()
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="0.0.0.0", help="address to bind (default: 0.0.0.0)")
    server.add_argument("--port", type=_port, default=8000, help="port to bind (default: 8000)")
    server.add_argument(
        "--served-model-name",
        default=None,
        help="model name clients send (default: --model, or "
        f"{DEFAULT_SERVED_MODEL_NAME} for the bundled model)",
    )
    server.add_argument(
        "--max-concurrency",
        type=int,
        default=512,
        help="requests in flight at once (running + waiting); more are refused "
        "with 429 and Retry-After (default: 512)",
    )
    server.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved configuration and deployment plan as JSON and exit "
        "without loading weights",
    )
    server.add_argument(
        "--timeout-graceful-shutdown",
        type=float,
        default=10,
        help="seconds in-flight requests may run on after SIGINT/SIGTERM before they are "
        "cancelled (aborted, their KV blocks freed) (default: 10)",
    )
    server.add_argument(
        "--disable-frontend-multiprocessing",
        action="store_true",
        help="run the engine loop on a thread of the server process instead of a process of "
        "its own (one GIL: slower when the model's step is host-bound)",
    )
    server.add_argument(
        "--api-server-count",
        type=int,
        default=1,
        help="API server processes serving the port, all in front of one engine process "
        "(vLLM's flag): spreads the HTTP and SSE work of many concurrent streams over more "
        "cores; --max-concurrency is shared out among them (default: 1)",
    )
    server.add_argument(
        "--engine-stall-timeout",
        type=float,
        default=DEFAULT_ENGINE_STALL_TIMEOUT_S,
        help="seconds the engine may go without finishing a step while it has work before "
        "/health answers 503 (stalled; 200 again when steps resume); 0: never. Raise it for "
        "long CPU steps: 8,192 prompt tokens in one step can take minutes there "
        f"(default: {DEFAULT_ENGINE_STALL_TIMEOUT_S:g})",
    )
    server.add_argument(
        "--api-key",
        nargs="+",
        action="extend",
        default=None,
        metavar="KEY",
        help="require 'Authorization: Bearer <KEY>' on every route but /health and /metrics "
        "(vLLM's flag; several keys: any is accepted); unset, FD_API_KEY, else VLLM_API_KEY "
        "(the environment keeps the key out of the process list) (default: none, open)",
    )
    limits = parser.add_argument_group(
        "request limits", "each refusal is counted in fastdeploy:request_rejected_total"
    )
    limits.add_argument(
        "--h11-max-header-count",
        type=_positive(int),
        default=HTTPLimits.max_header_count,
        help="headers in one request; more: 431 (vLLM's flag; here with httptools too) "
        f"(default: {HTTPLimits.max_header_count})",
    )
    limits.add_argument(
        "--h11-max-incomplete-event-size",
        type=_positive(int),
        default=HTTPLimits.max_header_bytes,
        help="bytes of a request's line and headers; more: 431 (vLLM's flag; here with "
        f"httptools too) (default: {HTTPLimits.max_header_bytes})",
    )
    limits.add_argument(
        "--max-request-body-bytes",
        type=_positive(int),
        default=HTTPLimits.max_body_bytes,
        help=f"bytes of a request body; more: 413 (default: {HTTPLimits.max_body_bytes})",
    )
    limits.add_argument(
        "--request-read-timeout",
        type=_positive(float),
        default=HTTPLimits.read_timeout_s,
        help="seconds a request's headers may take to arrive, and again its body; later: 408 "
        f"and the connection is closed (default: {HTTPLimits.read_timeout_s:g})",
    )
    for name, default, ceiling, what in zip(
        ("--max-stop-strings", "--max-stop-chars", "--max-stop-token-ids"),
        DEFAULT_STOP_LIMITS,
        MAX_STOP_LIMITS,
        ("stop strings", "characters in all stop strings", "stop_token_ids"),
    ):
        limits.add_argument(
            name,
            type=_positive(int),
            default=default,
            help=f"{what} of one request, at most {ceiling}; more: 400 (default: {default})",
        )
    tools = parser.add_argument_group("tool calling", "see docs/tool-calling.md")
    tools.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='serve tool_choice "auto" (the default of a request with tools), parsed with '
        "--tool-call-parser (vLLM's flag); without it such a request is a 400 (required and "
        "named functions are served either way)",
    )
    tools.add_argument(
        "--tool-call-parser",
        default=None,
        help="the format of the model's tool calls: "
        + ", ".join(TOOL_CALL_PARSERS)
        + " (<tool_call> JSON: Hermes, Qwen2/2.5/3, SmolLM2) (vLLM's flag) (default: none)",
    )
    tools.add_argument(
        "--chat-template",
        default=None,
        help="the chat template, a file's path or the template itself, used instead of the "
        "model's for every chat request (vLLM's flag) (default: the model's; for requests "
        "with tools, the shipped Hermes template when the model's does not render tools)",
    )
    server.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="log level (default: info)",
    )
    EngineArgs.add_cli_args(parser)
    return parser


def env_help() -> str:
    """The ``--help`` epilog: every ``FD_*`` environment variable, its default and meaning."""
    import textwrap

    lines = ["environment variables:"]
    for var in envs.describe():
        lines.append(f"  {var.name} (default: {var.default})")
        lines += textwrap.wrap(var.doc, 76, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(lines)


def served_name(args: argparse.Namespace) -> str:
    """``--served-model-name``, else ``--model`` as given, else the bundled model's name."""
    return args.served_model_name or args.model or DEFAULT_SERVED_MODEL_NAME


def _port(text: str) -> int:
    """argparse type of ``--port``: an integer in 0..65535."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"--port={text!r} is invalid; allowed: 0..65535")
    return port


def _positive(kind: type) -> Any:
    """argparse type: a number of ``kind`` > 0."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = 0
        if not value > 0:
            what = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"{text!r} is invalid; allowed: {what} > 0")
        return value

    parse.__name__ = kind.__name__
    return parse


def request_limits(args: argparse.Namespace) -> tuple[HTTPLimits, StopLimits]:
    """The request limits of the server's flags.

    Raises:
        ValueError: a limit out of range, naming its flag.
    """
    try:
        http = HTTPLimits(
            max_header_count=args.h11_max_header_count,
            max_header_bytes=args.h11_max_incomplete_event_size,
            max_body_bytes=args.max_request_body_bytes,
            read_timeout_s=args.request_read_timeout,
        )
        stop = StopLimits(args.max_stop_strings, args.max_stop_chars, args.max_stop_token_ids)
    except ValueError as e:
        name, _, rest = str(e).partition("=")
        raise ValueError(f"--{name.replace('_', '-')}={rest}") from None
    return http, stop


@dataclasses.dataclass(frozen=True)
class FlagRule:
    """One rule on a server flag: where ``holds(args)`` is false, start-up refuses with
    ``--<flag>=<value> is invalid<context>; allowed: <allowed(args)>``. A rule owned elsewhere
    is called by ``holds``, which then raises its owner's ``ValueError`` itself."""

    flag: str
    holds: Callable[[argparse.Namespace], bool]
    allowed: Callable[[argparse.Namespace], str]
    context: str = ""

    def error(self, args: argparse.Namespace) -> str | None:
        """The refusal's message, or None when the rule holds."""
        if self.holds(args):
            return None
        value = getattr(args, self.flag)
        name = "--" + self.flag.replace("_", "-")
        return f"{name}={value} is invalid{self.context}; allowed: {self.allowed(args)}"


def _stall_timeout_holds(args: argparse.Namespace) -> bool:
    """``--engine-stall-timeout``'s rule is its owner's (``check_stall_timeout``), which raises."""
    check_stall_timeout(args.engine_stall_timeout)
    return True


#: The rules on the server's own flags, checked in order by :func:`check_server_args` (the
#: engine's flags are checked by the config they build).
SERVER_FLAG_RULES: tuple[FlagRule, ...] = (
    FlagRule("max_concurrency", lambda a: a.max_concurrency >= 1, lambda a: "an integer >= 1"),
    FlagRule("engine_stall_timeout", _stall_timeout_holds, lambda a: ""),
    FlagRule(
        "api_server_count",
        lambda a: 1 <= a.api_server_count <= a.max_concurrency,
        lambda a: f"1..--max-concurrency ({a.max_concurrency})",
    ),
    FlagRule(
        "api_server_count",
        lambda a: a.api_server_count == 1 or not a.disable_frontend_multiprocessing,
        lambda a: "1",
        context=" with --disable-frontend-multiprocessing (the API server processes share an "
        "engine process)",
    ),
)


def check_server_args(args: argparse.Namespace) -> None:
    """Check the server's own flags (:data:`SERVER_FLAG_RULES`, then the request limits of
    :func:`request_limits`).

    Raises:
        ValueError: the first rule broken, naming the flag, its value and what is allowed.
    """
    for rule in SERVER_FLAG_RULES:
        error = rule.error(args)
        if error is not None:
            raise ValueError(error)
    request_limits(args)
    tool_config(args)


def tool_config(args: argparse.Namespace) -> ToolServingConfig:
    """The tool flags as a :class:`ToolServingConfig` (``--chat-template``'s file read).

    Raises:
        ValueError: an unknown ``--tool-call-parser``, ``--enable-auto-tool-choice`` without
            it, or a ``--chat-template`` that is neither a file nor a template.
    """
    return tool_serving_config(
        getattr(args, "enable_auto_tool_choice", False),
        getattr(args, "tool_call_parser", None),
        getattr(args, "chat_template", None),
    )


def server_not_supported(args: argparse.Namespace, splitwise_role: str) -> list[str]:
    """One sentence per server flag this deployment cannot run yet (``--print-config`` lists
    them; start-up refuses them)."""
    if args.api_server_count > 1 and splitwise_role != "mixed":
        return [
            f"--api-server-count={args.api_server_count} with --splitwise-role={splitwise_role} "
            "is not supported yet; allowed there: 1"
        ]
    return []


def server_summary(args: argparse.Namespace) -> dict[str, Any]:
    """The server's settings as ``--print-config`` shows them (``server``); the API keys masked.

    Raises:
        ValueError: a request limit out of range, naming its flag.
    """
    server = {
        "host": args.host,
        "port": args.port,
        "served_model_name": served_name(args),
        "max_concurrency": args.max_concurrency,
        "engine_process": not args.disable_frontend_multiprocessing,
        "api_server_count": args.api_server_count,
        "engine_stall_timeout": args.engine_stall_timeout,
        "api_key": mask(getattr(args, "api_key", None)),
        "enable_auto_tool_choice": getattr(args, "enable_auto_tool_choice", False),
        "tool_call_parser": getattr(args, "tool_call_parser", None),
        "chat_template": getattr(args, "chat_template", None),
    }
    http_limits, stop_limits = request_limits(args)
    server["limits"] = {
        **dataclasses.asdict(http_limits),
        **{k: v for k, v in dataclasses.asdict(stop_limits).items() if k != "flags"},
    }
    return server
