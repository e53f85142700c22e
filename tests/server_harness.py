"""Starts the real ``sglang.launch_server`` on the CPU platform for tests, and stops it.

Every server gets a free loopback port and its own log file; a failed start raises with the
log's tail so the cause is visible in the test report.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import requests

READY_TIMEOUT_S = float(os.environ.get("SGLANG_M3_TEST_SERVER_TIMEOUT", "600"))
#: Prefill chunk of the shared tiny-M3 test servers: not a multiple of the tiny model's MSA block
#: (16), so chunks start mid-block; prompts longer than this are prefilled in several passes.
TINY_PREFILL_CHUNK = 100


@dataclass
class RunningServer:
    base_url: str
    model_path: str
    log_path: str
    process: subprocess.Popen

    @property
    def openai_url(self) -> str:
        return f"{self.base_url}/v1"

    def log_tail(self, lines: int = 60) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as handle:
            return "".join(handle.readlines()[-lines:])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
def launch_cpu_server(model_path: str, log_dir: str, *extra: str, env: dict[str, str] | None = None):
    """Serve ``model_path`` on the project's CPU platform; ``env`` overrides the server's environment."""
    with _serving(start_cpu_server(model_path, log_dir, *extra, env=env)) as server:
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
    """``sglang-m3 serve`` of a recipe of the tiny model (cpu profile), its checkpoint cached under
    ``root``; yields the ready server, whose ``model_path`` is the checkpoint directory."""
    from sglang_m3.tiny.checkpoint import BUILD_FORMAT, build_tiny_checkpoint

    cache = os.path.join(root, "cache")
    # serve builds the tiny checkpoint here unless it exists: build it first to know its path.
    model_dir = build_tiny_checkpoint(os.path.join(cache, f"tiny-m3-v{BUILD_FORMAT}-seed0"), seed=0)
    port = free_port()
    log_path = os.path.join(root, "serve.log")
    command = [sys.executable, "-m", "sglang_m3.cli", "serve", recipe_path, "--host", "127.0.0.1", "--port", str(port), *extra]
    process = _spawn(command, log_path, {**os.environ, "SGLANG_M3_CACHE": cache})
    try:
        with _serving(RunningServer(f"http://127.0.0.1:{port}", model_dir, log_path, process)) as server:
            yield server
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, 9)  # serve's SGLang children, if serve exited first


def start_cpu_server(model_path: str, log_dir: str, *extra: str, env: dict[str, str] | None = None) -> RunningServer:
    """Spawn the server process (not waiting for it); the caller stops it with ``_stop``."""
    port = free_port()
    log_path = os.path.join(log_dir, f"sglang-{port}.log")
    env = {
        **os.environ,
        "SGLANG_PLATFORM": "sglang_m3_cpu",
        "SGLANG_EXTERNAL_MODEL_PACKAGE": "sglang_m3.models",
        **(env or {}),
    }
    process = _spawn([sys.executable, "-m", "sglang.launch_server", *cpu_server_args(model_path, port, *extra)], log_path, env)
    return RunningServer(f"http://127.0.0.1:{port}", model_path, log_path, process)


def _spawn(command: list[str], log_path: str, env: dict[str, str]) -> subprocess.Popen:
    """``command`` in its own session (stopped as a group), stdout and stderr into ``log_path``."""
    with open(log_path, "w", encoding="utf-8") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _wait_ready(server: RunningServer) -> None:
    deadline = time.time() + READY_TIMEOUT_S
    while time.time() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"SGLang exited with {server.process.returncode}:\n{server.log_tail()}")
        try:
            if requests.get(f"{server.base_url}/health_generate", timeout=30).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(2)
    raise TimeoutError(f"SGLang did not become ready in {READY_TIMEOUT_S} s:\n{server.log_tail()}")


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, 15)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, 9)
        process.wait()


@dataclass
class RefusedStart:
    """A server that exited during start-up: its exit status, how long it ran, its whole log."""

    returncode: int
    seconds: float
    log: str


def expect_start_refused(model_path: str, log_dir: str, *extra: str, timeout_s: float = 300.0) -> RefusedStart:
    """Start a server that must refuse to start; fails if it became ready or is still up after
    ``timeout_s``. The server is stopped in every case."""
    server = start_cpu_server(model_path, log_dir, *extra)
    started = time.time()
    try:
        while time.time() - started < timeout_s:
            if server.process.poll() is not None:
                with open(server.log_path, encoding="utf-8", errors="replace") as handle:
                    return RefusedStart(server.process.returncode, time.time() - started, handle.read())
            with contextlib.suppress(requests.RequestException):
                if requests.get(f"{server.base_url}/health_generate", timeout=5).status_code == 200:
                    raise AssertionError(f"SGLang started serving a config it should refuse:\n{server.log_tail()}")
            time.sleep(1)
        raise TimeoutError(f"SGLang neither served nor exited in {timeout_s} s:\n{server.log_tail()}")
    finally:
        _stop(server.process)
