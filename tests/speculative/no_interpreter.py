"""Test servers started without ``TRITON_INTERPRET`` in their environment.

The root conftest sets ``TRITON_INTERPRET=1`` in the pytest process (the kernel tests run
Triton in its interpreter) and the harness hands the process environment to every server, so
a served test would not notice a CPU server that still launches a Triton kernel. A user's plain
``sglang-m3 serve`` / ``python -m sglang.launch_server`` on a CPU has no such variable: servers
started here lack it too, read back from the server process's ``/proc`` entry.
"""

from __future__ import annotations

import contextlib
import os

from server_harness import _stop, _wait_ready, server_environment, start_cpu_server

INTERPRETER_VARIABLE = "TRITON_INTERPRET"


def environment_without_interpreter() -> dict[str, str]:
    """The environment of the servers started here."""
    return server_environment(without=(INTERPRETER_VARIABLE,))


@contextlib.contextmanager
def launch_without_interpreter(model_path: str, log_dir: str, *extra: str, env: dict[str, str] | None = None):
    """``launch_cpu_server`` with ``TRITON_INTERPRET`` removed from the server's environment
    (``env`` overrides part of the rest, as there)."""
    server = start_cpu_server(model_path, log_dir, *extra, env=env, without=(INTERPRETER_VARIABLE,))
    try:
        assert INTERPRETER_VARIABLE not in process_environment(server.process.pid)
        _wait_ready(server)
        yield server
    finally:
        _stop(server.process)


def process_environment(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as handle:
        entries = handle.read().decode(errors="replace").split("\0")
    return dict(entry.split("=", 1) for entry in entries if "=" in entry)
