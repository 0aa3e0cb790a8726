"""Session-wide test setup.

A test run stopped with SIGTERM (a CI time limit, ``kill``, ``timeout``) unwinds as Ctrl-C does:
pytest then runs the fixtures' teardown, so the servers and worker processes that tests start in
their own sessions are stopped too (the default SIGTERM action ends pytest at once and leaves them
running).
"""

import signal
import threading


def pytest_configure(config):
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.default_int_handler)
