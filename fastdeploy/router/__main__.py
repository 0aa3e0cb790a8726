"""``python -m fastdeploy.router``: the same as ``fastdeploy router``."""

import sys

from fastdeploy.router.cli import main

sys.exit(main())
