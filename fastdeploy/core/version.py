"""This package's version, in one place: ``fastdeploy.__version__`` re-exports it and the
server's ``GET /version`` answers it (the server's side may import ``core``, not the package's
top level). Keep it equal to ``setup.py``'s ``version``."""

__version__ = "0.1.0"
