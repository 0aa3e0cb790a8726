"""``python -m fastdeploy.integrations.dynamo [flags]``: run one Dynamo worker (see
:func:`fastdeploy.integrations.dynamo.engine.run_worker`)."""

import sys

if __name__ == "__main__":
    from fastdeploy.integrations.dynamo.args import make_worker_parser
    from fastdeploy.integrations.dynamo.launch import run_from_args

    sys.exit(run_from_args(make_worker_parser().parse_args()))
