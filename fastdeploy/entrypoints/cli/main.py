"""The ``fastdeploy`` command line.

Subcommands:
  * ``fastdeploy serve [args]``: the OpenAI-compatible server; the same arguments as
    ``python -m fastdeploy.entrypoints.openai.api_server`` (one parser builder,
    :func:`fastdeploy.entrypoints.server_args.make_arg_parser`; start-up in
    :mod:`fastdeploy.entrypoints.launch`).
  * ``fastdeploy dynamo-worker [args]``: the engine as an NVIDIA Dynamo worker (``serve``'s
    engine flags plus Dynamo's; :mod:`fastdeploy.integrations.dynamo`).

Examples: ``fastdeploy serve --port 8000``, ``fastdeploy serve --print-config --device cuda``.
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one sub-parser per subcommand."""
    from fastdeploy.entrypoints.openai.api_server import run_server
    from fastdeploy.entrypoints.server_args import make_arg_parser
    from fastdeploy.integrations.dynamo.args import make_worker_parser
    from fastdeploy.integrations.dynamo.launch import run_from_args
    from fastdeploy.router.cli import make_router_parser, run_router

    parser = argparse.ArgumentParser(prog="fastdeploy", description="FastDeploy-style LLM engine")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    serve = subparsers.add_parser(
        "serve",
        help="start the OpenAI-compatible server",
        description="Start the OpenAI-compatible server (FastAPI + uvicorn).",
    )
    make_arg_parser(serve)
    serve.set_defaults(func=run_server)
    router = subparsers.add_parser(
        "router",
        help="start the router in front of PD pairs or plain replicas",
        description="Start the OpenAI-compatible router (FastAPI + an async HTTP client).",
    )
    make_router_parser(router)
    router.set_defaults(func=run_router)
    dynamo = subparsers.add_parser(
        "dynamo-worker",
        help="run the engine as an NVIDIA Dynamo worker (needs ai-dynamo)",
        description="Run the engine as an NVIDIA Dynamo worker behind Dynamo's frontend and "
        "KV router (token in, token out); the same as python -m fastdeploy.integrations.dynamo.",
    )
    make_worker_parser(dynamo)
    dynamo.set_defaults(func=run_from_args)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``fastdeploy`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
