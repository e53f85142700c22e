"""SIGTERM as an interrupt in the test process, so that the tests' own cleanup runs.

``timeout`` (a device call's limit, a CI runner's) ends a test run with SIGTERM, whose default
action ends pytest at once, before any ``finally`` block or fixture teardown. The servers the tests
start run in sessions of their own (``server_harness``, ``tests/gpu/gpu_server.py``), out of reach of
the signal to pytest's group, so they would outlive it: on the lent GPU such a server holds its
memory into the next command of the same call (a benchmark's server did, 120 GB, before
``e2e_gpu.start_server`` stopped its server on any exit). As ``KeyboardInterrupt`` the signal unwinds the running
test, and pytest then tears its fixtures down, which stops every server they started.
"""

from __future__ import annotations

import signal


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"stopped by signal {signum}")


def install() -> None:
    """Make SIGTERM raise ``KeyboardInterrupt`` in this process (call it from the main thread)."""
    signal.signal(signal.SIGTERM, _interrupt)
