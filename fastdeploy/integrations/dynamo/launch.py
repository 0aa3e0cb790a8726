"""Start-up of the Dynamo worker without importing Dynamo first: :func:`run_from_args` (used by
``fastdeploy dynamo-worker`` and ``python -m fastdeploy.integrations.dynamo``) says what to
install when the ``ai-dynamo`` package is missing, instead of a traceback."""

from __future__ import annotations

import argparse

#: What to install when ``dynamo`` is missing.
INSTALL_HINT = "pip install --no-deps ai-dynamo==1.6.1 ai-dynamo-runtime==1.6.1 (see .ci/run)"


def run_from_args(args: argparse.Namespace) -> int:
    """Run the worker of ``args`` (:func:`~.args.make_worker_parser`; see
    :func:`~.engine.run_worker`); exit status 2 with one ``error: ...`` line when the
    ``ai-dynamo`` package is not installed."""
    import sys

    try:
        from fastdeploy.integrations.dynamo.engine import run_worker
    except ImportError as e:
        if not (e.name or "").startswith("dynamo"):
            raise
        print(f"error: the Dynamo worker needs NVIDIA Dynamo: {INSTALL_HINT}", file=sys.stderr)
        return 2
    return run_worker(args)
