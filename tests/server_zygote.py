"""A warm interpreter that forks the test suite's SGLang servers instead of starting each cold.

Run as ``python server_zygote.py SOCKET``. It imports SGLang's serving stack and this project's
plugin once, then serves one request per connection on the Unix socket ``SOCKET``: a JSON line
``{"argv": [...], "env": {...}, "log_path": "..."}`` is answered with ``{"pid": N}`` for a forked
child that runs ``python -m sglang.launch_server ARGV`` (its own session, stdout and stderr into
``log_path``, the environment replaced by ``env``). When such a child exits, its exit status is
written to ``log_path + ".returncode"``.

Why: on the 2-core CI machines a cold ``import sglang`` costs minutes, and a server start paid it
three times (the launcher, then the scheduler and the detokenizer SGLang spawns), for each of the
suite's server starts. A forked child already holds every module, and SGLang's own subprocesses
are forked from it as well (``multiprocessing`` start method ``fork``; on the CPU platform no
CUDA context exists to forbid it). Everything after the imports - argument parsing, plugin
loading, the scheduler, the model, HTTP - runs exactly as in a cold start. What a fork cannot
check (a fresh interpreter's plugin discovery, import-time environment) stays covered by the
tests that start servers cold (``server_harness.start_cpu_server(..., cold=True)``).

The zygote exits when its parent (the test session) does.
"""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import runpy
import select
import signal
import socket
import sys
import traceback

#: Modules a server start imports in the launcher and in its scheduler and detokenizer.
PRELOAD = (
    "sglang.launch_server",
    "sglang.srt.entrypoints.http_server",
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.detokenizer_manager",
    "sglang.srt.model_executor.model_runner",
    "sglang_m3.plugin",
    "sglang_m3.models",
)


def main(socket_path: str) -> None:
    for module in PRELOAD:
        __import__(module)
    # A server that needs an architecture outside SGLANG_EXTERNAL_MODEL_PACKAGE (an EAGLE3 draft)
    # makes SGLang import every in-tree model module (a cached scan): once here, not per server.
    from sglang.srt.models.registry import import_model_classes

    import_model_classes("sglang.srt.models")
    parent = os.getppid()
    children: dict[int, str] = {}
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        # Bound under another name and renamed once listening: the path appears only when ready.
        listener.bind(f"{socket_path}.partial")
        listener.listen()
        os.rename(f"{socket_path}.partial", socket_path)
        print("zygote ready", flush=True)
        while os.getppid() == parent:
            ready, _, _ = select.select([listener], [], [], 0.5)
            _reap(children)
            if ready:
                connection, _ = listener.accept()
                with connection:
                    _serve_request(connection, listener, children)


def _serve_request(connection: socket.socket, listener: socket.socket, children: dict[int, str]) -> None:
    request = json.loads(connection.makefile("r", encoding="utf-8").readline())
    sys.stdout.flush()
    sys.stderr.flush()
    # Inherited objects go to the collector's permanent generation: a child's full collection
    # (SGLang runs one before sizing the KV pool) then neither walks them nor writes their headers,
    # which would copy every inherited page (40-65 s a start here, at about 0.2 ms a page fault).
    gc.freeze()
    pid = os.fork()
    if pid == 0:
        listener.close()
        connection.close()
        _run_server(request["argv"], request["env"], request["log_path"])
    children[pid] = request["log_path"]
    connection.sendall((json.dumps({"pid": pid}) + "\n").encode())


def _run_server(argv: list[str], env: dict[str, str], log_path: str) -> None:
    """The forked child: becomes ``python -m sglang.launch_server ARGV``; never returns."""
    code = 1
    try:
        os.setsid()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.environ.clear()
        os.environ.update(env)
        _fork_sglang_subprocesses()
        sys.argv = ["sglang.launch_server", *argv]
        runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    except BaseException:  # noqa: BLE001 - the child reports any failure in its log and exit status
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _fork_sglang_subprocesses() -> None:
    """SGLang sets the ``spawn`` start method for its scheduler and detokenizer; make it ``fork``."""
    set_start_method = multiprocessing.set_start_method

    def forking(method, force=False):
        set_start_method("fork", force=True)

    multiprocessing.set_start_method = forking
    set_start_method("fork", force=True)


def _reap(children: dict[int, str]) -> None:
    """Write each exited child's exit status beside its log (written whole, then renamed)."""
    for pid in list(children):
        done, status = os.waitpid(pid, os.WNOHANG)
        if not done:
            continue
        log_path = children.pop(pid)
        partial = f"{log_path}.returncode.partial"
        with open(partial, "w", encoding="ascii") as handle:
            handle.write(str(os.waitstatus_to_exitcode(status)))
        os.replace(partial, f"{log_path}.returncode")


if __name__ == "__main__":
    main(sys.argv[1])
    os._exit(0)  # tearing down every imported module would take minutes on a slow machine
