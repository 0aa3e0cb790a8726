"""The Dynamo worker's command line: every engine flag of ``fastdeploy serve`` (one parser
builder, :func:`fastdeploy.entrypoints.server_args.make_arg_parser`; ``--host``/``--port`` and the
HTTP limits are unused here) plus a ``dynamo`` group whose names and defaults are Dynamo 1.6's
(``--endpoint`` as its vLLM backend has it; ``--discovery-backend``, ``--request-plane``,
``--event-plane`` as every Dynamo component has them).
"""

from __future__ import annotations

import argparse

from fastdeploy.entrypoints.server_args import make_arg_parser

#: Where the worker serves unless ``--endpoint`` says otherwise (Dynamo's vLLM backend default).
DEFAULT_ENDPOINT = "dyn://dynamo.backend.generate"


def make_worker_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """``fastdeploy serve``'s parser plus the ``dynamo`` group; returns it (a new one when
    ``parser`` is None)."""
    if parser is None:
        parser = argparse.ArgumentParser(
            prog="python -m fastdeploy.integrations.dynamo",
            description="A FastDeploy engine as an NVIDIA Dynamo worker (token in, token out).",
        )
    make_arg_parser(parser)
    dyn = parser.add_argument_group("dynamo")
    dyn.add_argument(
        "--endpoint",
        default=DEFAULT_ENDPOINT,
        help=f"Dynamo endpoint to serve, dyn://namespace.component.endpoint "
        f"(default: {DEFAULT_ENDPOINT})",
    )
    dyn.add_argument(
        "--discovery-backend",
        default="etcd",
        choices=("etcd", "file", "mem", "kubernetes"),
        help="Dynamo discovery (default: etcd at $ETCD_ENDPOINTS, http://localhost:2379)",
    )
    dyn.add_argument(
        "--request-plane",
        default="tcp",
        choices=("tcp", "nats"),
        help="how the frontend sends requests here (default: tcp)",
    )
    dyn.add_argument(
        "--event-plane",
        default=None,
        choices=("nats", "zmq"),
        help="how KV events and load reach the router (default: Dynamo's choice; nats at "
        "$NATS_SERVER with etcd discovery)",
    )
    dyn.add_argument(
        "--no-dynamo-kv-events",
        dest="dynamo_kv_events",
        action="store_false",
        help="publish no KV-cache events to Dynamo's KV router (default: published on an IPC "
        "socket whenever prefix caching is on; --kv-events-config, if given, names the socket)",
    )
    return parser


def parse_endpoint(endpoint: str) -> tuple[str, str, str]:
    """``(namespace, component, endpoint)`` of ``dyn://ns.comp.ep`` (or ``ns.comp.ep``).

    Raises:
        ValueError: not three non-empty dot-separated names, naming the value.
    """
    parts = endpoint.removeprefix("dyn://").split(".")
    if len(parts) != 3 or not all(parts):
        raise ValueError(
            f"--endpoint={endpoint!r} is invalid; allowed: dyn://namespace.component.endpoint"
        )
    return parts[0], parts[1], parts[2]
