"""``python -m fastdeploy.integrations.dynamo [flags]``: run one Dynamo worker (see
:func:`fastdeploy.integrations.dynamo.engine.main`)."""

import sys

if __name__ == "__main__":
    from fastdeploy.integrations.dynamo.engine import main

    sys.exit(main())
