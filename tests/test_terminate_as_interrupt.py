"""SIGTERM to a test run unwinds it, so that servers started in sessions of their own are stopped.

``terminate_as_interrupt`` is installed by the root conftest; here a test process (a stand-in with
the same handler) starts a "server" in its own session, is sent SIGTERM the way ``timeout`` sends
it, and must leave no process of that session behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import terminate_as_interrupt
from server_harness import live_group_members

# A test process: installs the handler, starts a server stand-in in its own session (a leader that
# forks a child and sleeps), and stops it in ``finally``, as the harness's context managers do.
TEST_PROCESS = r"""
import os, signal, subprocess, sys, time
sys.path.insert(0, sys.argv[1])
import terminate_as_interrupt
from server_harness import stop_process_group
terminate_as_interrupt.install()
server = subprocess.Popen([sys.executable, "-c", "import os, time\nos.fork()\ntime.sleep(600)"], start_new_session=True)
try:
    print(server.pid, flush=True)
    time.sleep(600)
finally:
    stop_process_group(server, grace_s=10)
    print("stopped", flush=True)
"""


def test_sigterm_unwinds_into_the_cleanup_that_stops_a_server_in_its_own_session():
    tests_dir = os.path.dirname(__file__)
    runner = subprocess.Popen([sys.executable, "-c", TEST_PROCESS, tests_dir], stdout=subprocess.PIPE, text=True)
    server = int(runner.stdout.readline())
    runner.send_signal(signal.SIGTERM)
    rest, _ = runner.communicate(timeout=60)
    assert "stopped" in rest
    assert runner.returncode != 0  # the interrupt still ends the run as a failure
    assert live_group_members(server) == []


def test_the_root_conftest_installed_it_in_this_test_process():
    assert signal.getsignal(signal.SIGTERM) is terminate_as_interrupt._interrupt
