"""``stop_process_group``: a stopped server leaves no process of its group behind, and a stop
that comes after the server's pid was reused signals nothing.

The failure it guards against: a launcher that exits on SIGTERM while a child of its group keeps
running (an SGLang scheduler busy starting up), which used to outlive the benchmark's stop and
hold the GPU for the next server.
"""

from __future__ import annotations

import subprocess
import sys
import time

from server_harness import live_group_members, process_start_ticks, stop_process_group

# The leader starts a child of its own group, tells us both pids, and exits on SIGTERM; the child
# ignores SIGTERM (or, with "polite", exits on it too).
LAUNCHER = r"""
import os, signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", '''
import signal, sys, time
if sys.argv[1] != "polite":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ready", flush=True)
time.sleep(600)
''', sys.argv[1]], stdout=subprocess.PIPE, text=True)
child.stdout.readline()
signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
print(os.getpid(), child.pid, flush=True)  # after the handler: a SIGTERM from now on exits 0
time.sleep(600)
"""


def _launch(child_mode: str) -> tuple[subprocess.Popen, int]:
    process = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, child_mode], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    leader, child = (int(pid) for pid in process.stdout.readline().split())
    assert leader == process.pid
    process.start_ticks = process_start_ticks(process.pid)  # as the harness records its servers'
    assert sorted(live_group_members(process.pid)) == sorted([leader, child])
    return process, child


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace_period():
    process, child = _launch("stubborn")
    started = time.monotonic()
    stop_process_group(process, grace_s=1.0)
    took = time.monotonic() - started
    assert live_group_members(process.pid) == []
    assert process.returncode == 0  # the leader went on SIGTERM; only its child needed SIGKILL
    assert 1.0 <= took < 20, took


def test_a_group_that_exits_on_sigterm_is_not_waited_for():
    process, _child = _launch("polite")
    started = time.monotonic()
    stop_process_group(process, grace_s=30.0)
    assert live_group_members(process.pid) == []
    assert time.monotonic() - started < 10


def test_a_group_whose_leader_already_exited_still_has_its_children_stopped():
    process, child = _launch("stubborn")
    process.terminate()  # the leader alone, as when SGLang's launcher dies first
    process.wait(timeout=10)
    assert live_group_members(process.pid) == [child]
    stop_process_group(process, grace_s=0.5)
    assert live_group_members(process.pid) == []


def test_a_pid_that_now_names_another_process_is_left_alone():
    """A stop long after its server exited: the pid leads another session now (here a sleeper
    standing in for another worker's server), so nothing is signalled."""
    from server_harness import ForkedServer

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    try:
        ticks = process_start_ticks(other.pid)
        assert ticks is not None
        gone = ForkedServer(other.pid, "/nonexistent/returncode", returncode=0, start_ticks=ticks - 1)
        stop_process_group(gone, grace_s=0.5)
        assert other.poll() is None, "stop_process_group signalled a process started after the one it was given"
        assert live_group_members(other.pid) == [other.pid]
    finally:
        other.kill()
        other.wait(timeout=10)
