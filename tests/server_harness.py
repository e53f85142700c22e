"""Starts the real ``sglang.launch_server`` on the CPU platform for tests, and stops it.

Every server gets a free loopback port and its own log file; a failed start raises with the
log's tail so the cause is visible in the test report. Servers are forked from a warm
interpreter (``server_zygote``, one per import-time environment) unless started ``cold``: the
launch is SGLang's own ``__main__`` either way, without paying SGLang's imports again.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import requests

from sglang_m3.serve_support import CPU_PLATFORM_ENV

#: How long a forked server may take to answer its health check. One to three minutes on a slow
#: 2-core machine, but the session's first EAGLE3 server also compiles SGLang's ``torch.compile``d
#: draft helper (C++ through inductor) in its warm-up request.
READY_TIMEOUT_S = float(os.environ.get("SGLANG_M3_TEST_SERVER_TIMEOUT", "1200"))
#: Prefill chunk of the shared tiny-M3 test servers: not a multiple of the tiny model's MSA block
#: (16), so chunks start mid-block; prompts longer than this are prefilled in several passes.
TINY_PREFILL_CHUNK = 100
#: How long a zygote may take to import SGLang's serving stack, and a cold server to start (it
#: imports it three times): minutes on a slow 2-core machine that also writes the bytecode cache.
IMPORTING_TIMEOUT_S = 3 * READY_TIMEOUT_S


@dataclass
class RunningServer:
    base_url: str
    model_path: str
    log_path: str
    process: subprocess.Popen | ForkedServer
    ready_timeout_s: float = READY_TIMEOUT_S

    @property
    def openai_url(self) -> str:
        return f"{self.base_url}/v1"

    def log_tail(self, lines: int = 60) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as handle:
            return "".join(handle.readlines()[-lines:])


def free_port() -> int:
    """A free loopback port below the kernel's ephemeral range.

    The port is only reserved once the server binds it, a minute or more later. A port the kernel
    hands out itself (``bind(0)``) can meanwhile be handed to another socket that binds port 0 -
    the server's own NCCL or gloo rendezvous, seen taking it on two GPUs - and the server then
    fails to bind. Ports below the ephemeral range are only taken by name.
    """
    low = _ephemeral_low()
    for _ in range(200):
        port = random.randrange(max(1024, low - 20000), low)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port below {low}")


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as handle:
            return int(handle.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def cpu_server_args(model_path: str, port: int, *extra: str) -> list[str]:
    return [
        "--model-path", model_path, "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--max-total-tokens", "8192", "--context-length", "4096",
        "--mem-fraction-static", "0.3", "--max-running-requests", "8", "--enable-cache-report",
        # An idle scheduler otherwise spins on its sockets; several test servers share 2 cores.
        "--sleep-on-idle",
        *extra,
    ]


@contextlib.contextmanager
def launch_cpu_server(model_path: str, log_dir: str, *extra: str, env: dict[str, str] | None = None, cold: bool = False):
    """Serve ``model_path`` on the project's CPU platform (``env`` and ``cold``: see ``start_cpu_server``)."""
    with _serving(start_cpu_server(model_path, log_dir, *extra, env=env, cold=cold)) as server:
        yield server


@contextlib.contextmanager
def _serving(server: RunningServer):
    """A spawned server once it is ready; stopped on the way out, ready or not."""
    try:
        _wait_ready(server)
        yield server
    finally:
        _stop(server.process)


@contextlib.contextmanager
def serve_tiny_recipe(recipe_path: str, root, *extra: str):
    """The server ``sglang-m3 serve RECIPE`` launches - the SGLang arguments and environment the
    command's own ``build_launch`` renders, the tiny checkpoint cached under ``root`` - forked from
    a zygote (``tests/test_serve_command.py`` runs the command itself, cold). Yields the ready
    server, whose ``model_path`` is the checkpoint directory."""
    from sglang_m3.commands.serve import build_launch, split_command_line

    cache = os.path.join(root, "cache")
    port = free_port()
    command_line = [recipe_path, "--host", "127.0.0.1", "--port", str(port), *extra]
    with _environment_variable("SGLANG_M3_CACHE", cache):
        argv, launch_env = build_launch(split_command_line(command_line))
    env = {**session_environment(), "SGLANG_M3_CACHE": cache, **launch_env}  # as the command runs it
    log_path = os.path.join(root, "serve.log")
    process = _zygote_for(env).fork_server(argv, env, log_path)
    model_dir = argv[argv.index("--model-path") + 1]
    with _serving(RunningServer(f"http://127.0.0.1:{port}", model_dir, log_path, process)) as server:
        yield server


@contextlib.contextmanager
def _environment_variable(name: str, value: str):
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            del os.environ[name]
        else:
            os.environ[name] = saved


_SERVER_NUMBERS = itertools.count(1)


def start_cpu_server(
    model_path: str, log_dir: str, *extra: str, env: dict[str, str] | None = None, without: tuple[str, ...] = (),
    cold: bool = False,
) -> RunningServer:
    """Start the server (not waiting for it); the caller stops it with ``_stop``. ``env`` overrides
    part of its environment and ``without`` names variables it lacks; ``cold`` starts it in a fresh
    interpreter, as a user's shell does, rather than forked from a warm one."""
    port = free_port()
    # Named by port and start time: a later server on the same port must not overwrite the log of
    # one that failed (a CI failure once named a log that the next server on its port had replaced).
    log_path = os.path.join(log_dir, f"sglang-{port}-{time.strftime('%H%M%S')}-{next(_SERVER_NUMBERS)}.log")
    env = {**server_environment(without), **(env or {})}
    argv = cpu_server_args(model_path, port, *extra)
    base_url = f"http://127.0.0.1:{port}"
    if cold:
        process = _spawn([sys.executable, "-m", "sglang.launch_server", *argv], log_path, env)
        return RunningServer(base_url, model_path, log_path, process, IMPORTING_TIMEOUT_S)
    return RunningServer(base_url, model_path, log_path, _zygote_for(env).fork_server(argv, env, log_path))


#: Variables the project reads when it uses them, not when it is imported: servers that differ
#: only in these share a zygote. Any other difference (``TRITON_INTERPRET``, ``PYTHONPATH``, ...)
#: can change what an import does, so it gets a zygote started with it.
CALL_TIME_PREFIX = "SGLANG_M3_"

#: The session's environment when the harness was imported (the root conftest has set
#: ``TRITON_INTERPRET`` by then). Servers start from it rather than from the live ``os.environ``,
#: which imports in the pytest process add to (each difference would need a zygote of its own);
#: only the call-time variables, which tests set with ``monkeypatch``, are read live.
def _import_time_part(env: dict[str, str]) -> dict[str, str]:
    return {key: value for key, value in env.items() if not key.startswith(CALL_TIME_PREFIX)}


_SESSION_ENVIRONMENT = _import_time_part(dict(os.environ))


def session_environment() -> dict[str, str]:
    """The environment of a process the tests start: the session's, with the live call-time variables."""
    return {**_SESSION_ENVIRONMENT, **{key: value for key, value in os.environ.items() if key.startswith(CALL_TIME_PREFIX)}}


def cpu_recipe_environment() -> dict[str, str]:
    """The environment of ``serve_tiny_recipe``'s servers for CPU-profile recipes (the library's
    ``cpu-tiny.yaml`` as the command renders it), to start their zygote ahead."""
    from sglang_m3.recipe import load_recipe, render_launch

    recipe = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes", "cpu-tiny.yaml")
    return {**session_environment(), **render_launch(load_recipe(recipe)).env}


def server_environment(without: tuple[str, ...] = ()) -> dict[str, str]:
    """The environment a test server gets unless a test overrides part of it; lacking ``without``."""
    env = {**session_environment(), **CPU_PLATFORM_ENV}
    for name in without:
        env.pop(name, None)
    return env


_zygotes: dict[frozenset, Zygote] = {}


def _zygote_for(env: dict[str, str]) -> Zygote:
    import_env = _import_time_part(env)
    key = frozenset(import_env.items())
    if key not in _zygotes:
        _zygotes[key] = Zygote(import_env)
    return _zygotes[key]


def start_zygote(env: dict[str, str]) -> None:
    """Start the zygote of servers with environment ``env`` now, so that its imports overlap the
    tests that run before the first server."""
    _zygote_for(env)


@dataclass
class ForkedServer:
    """A server forked by a zygote, with the part of ``subprocess.Popen`` the harness uses. The
    zygote reaps it and writes its exit status to ``returncode_path``."""

    pid: int
    returncode_path: str
    returncode: int | None = None
    start_ticks: int | None = None  # see ``process_start_ticks``

    #: The exit status of a server gone without one written: its zygote died before reaping it.
    LOST = -255

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._written_returncode()
        if self.returncode is None and not _exists(self.pid):
            time.sleep(1)  # reaped a moment ago: the zygote writes the status right after
            self.returncode = self._written_returncode()
            if self.returncode is None:
                self.returncode = self.LOST
        return self.returncode

    def _written_returncode(self) -> int | None:
        if not os.path.exists(self.returncode_path):
            return None
        with open(self.returncode_path, encoding="ascii") as handle:
            return int(handle.read())

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.time() + timeout
        while self.poll() is None:
            if deadline is not None and time.time() > deadline:
                raise subprocess.TimeoutExpired(f"server {self.pid}", timeout)
            time.sleep(0.2)
        return self.returncode


def _exists(pid: int) -> bool:
    """Whether process ``pid`` exists (an exited one not yet reaped does)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class Zygote:
    """``server_zygote.py`` running with ``env``; forks servers once its imports are done."""

    def __init__(self, env: dict[str, str]):
        folder = tempfile.mkdtemp(prefix="sglang-m3-zygote-")
        self.socket_path = os.path.join(folder, "socket")
        self.log_path = os.path.join(folder, "zygote.log")
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "server_zygote.py")
        self.process = _spawn([sys.executable, script, self.socket_path], self.log_path, env)
        atexit.register(_stop, self.process)

    def fork_server(self, argv: list[str], env: dict[str, str], log_path: str) -> ForkedServer:
        self._wait_ready()
        request = json.dumps({"argv": argv, "env": env, "log_path": log_path}) + "\n"
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
            connection.connect(self.socket_path)
            connection.sendall(request.encode())
            reply = json.loads(connection.makefile("r", encoding="utf-8").readline())
        return ForkedServer(reply["pid"], f"{log_path}.returncode", start_ticks=process_start_ticks(reply["pid"]))

    def _wait_ready(self) -> None:
        deadline = time.time() + IMPORTING_TIMEOUT_S
        while not os.path.exists(self.socket_path):
            if self.process.poll() is not None or time.time() > deadline:
                with open(self.log_path, encoding="utf-8", errors="replace") as handle:
                    raise RuntimeError(f"the server zygote did not start:\n{handle.read()[-6000:]}")
            time.sleep(0.5)


def _spawn(command: list[str], log_path: str, env: dict[str, str]) -> subprocess.Popen:
    """``command`` in its own session (stopped as a group), stdout and stderr into ``log_path``."""
    with open(log_path, "w", encoding="utf-8") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    process.start_ticks = process_start_ticks(process.pid)
    return process


def process_start_ticks(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot, ``/proc``), None if there is none.

    A pid names one process only while it lives: recorded at start, it tells a stop much later
    whether ``pid`` still names that server or a process started since (``stop_process_group``).
    """
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
            stat = handle.read()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[19])  # field 22, counted after the command name


def _wait_ready(server: RunningServer) -> None:
    deadline = time.time() + server.ready_timeout_s
    while time.time() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"SGLang exited with {server.process.returncode}:\n{server.log_tail()}")
        try:
            if requests.get(f"{server.base_url}/health_generate", timeout=300).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(2)
    raise TimeoutError(f"SGLang did not become ready in {server.ready_timeout_s} s:\n{server.log_tail()}")


def _stop(process: subprocess.Popen | ForkedServer) -> None:
    stop_process_group(process, grace_s=30)


def stop_process_group(process: subprocess.Popen | ForkedServer, grace_s: float) -> None:
    """Stop ``process`` (started in its own session) and every process of its group.

    SGLang's launcher can exit on SIGTERM while its schedulers are still busy (compiling kernels,
    capturing graphs) and outlive it: waiting for the launcher alone once left two schedulers
    holding a GPU's memory into the next server's start. So the whole group gets SIGTERM, and
    SIGKILL for whatever is still running after ``grace_s``.

    A server whose group emptied long before its stop (it exited on its own) leaves its pid free:
    the CI machine's pids wrap at 32,768 and tests run in two workers, so by then the pid may lead
    another worker's server, whose group the signal would reach. When the process recorded its
    start (``start_ticks``) and ``pid`` now names a later process, there is nothing of ours to stop.
    """
    pgid = process.pid
    recorded = getattr(process, "start_ticks", None)
    if recorded is not None and process_start_ticks(pgid) not in (None, recorded):
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    if _group_gone(process, pgid, grace_s):
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    if not _group_gone(process, pgid, 30):
        raise RuntimeError(f"processes {live_group_members(pgid)} of group {pgid} outlived SIGKILL")


def _group_gone(process: subprocess.Popen | ForkedServer, pgid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        process.poll()  # reaps the leader: a zombie would still count as a member
        if not live_group_members(pgid):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def live_group_members(pgid: int) -> list[int]:
    """PIDs of the processes of group ``pgid`` that have not exited (zombies left out), from /proc."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as handle:
                stat = handle.read()
        except OSError:  # exited while listed
            continue
        state, _parent, group = stat[stat.rindex(")") + 2:].split()[:3]
        if state != "Z" and int(group) == pgid:
            members.append(int(entry))
    return members


@dataclass
class RefusedStart:
    """A server that exited during start-up: its exit status and its whole log."""

    returncode: int
    log: str


def expect_start_refused(model_path: str, log_dir: str, *extra: str) -> RefusedStart:
    """Start a server that must refuse to start; fails if it became ready or is still up after
    ``READY_TIMEOUT_S`` (as long as a start may take). The server is stopped in every case."""
    server = start_cpu_server(model_path, log_dir, *extra)
    started = time.time()
    try:
        while time.time() - started < READY_TIMEOUT_S:
            if server.process.poll() is not None:
                with open(server.log_path, encoding="utf-8", errors="replace") as handle:
                    return RefusedStart(server.process.returncode, handle.read())
            with contextlib.suppress(requests.RequestException):
                if requests.get(f"{server.base_url}/health_generate", timeout=5).status_code == 200:
                    raise AssertionError(f"SGLang started serving a config it should refuse:\n{server.log_tail()}")
            time.sleep(1)
        raise TimeoutError(f"SGLang neither served nor exited in {READY_TIMEOUT_S} s:\n{server.log_tail()}")
    finally:
        _stop(server.process)
