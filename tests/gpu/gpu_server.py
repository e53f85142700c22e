"""Starts the real ``sglang.launch_server`` on a CUDA GPU for the GPU tests.

On the lent GPU machine ``scripts/gpu/run.sh tests`` selects the harness platform
(``SGLANG_PLATFORM=m3_gpu_harness``); on a GPU node with the stock SGLang install nothing is
selected and SGLang's in-tree CUDA platform serves. Each server writes its log beside the others
(under ``$OUT`` when set) so a failed start shows its cause.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

from server_harness import RunningServer, _stop, _wait_ready, free_port

# fp32 dots in Triton kernels (SGLang's attention, the fused MoE, the MSA kernels) default to tf32;
# the exactness tests compare against transformers in fp32, so they ask Triton for IEEE fp32.
EXACT_ENV = {"TRITON_F32_DEFAULT": "ieee"}


def gpu_server_args(model_path: str, port: int, *extra: str, dtype: str = "float32", prefill_graphs: bool = True) -> list[str]:
    """Decode CUDA graphs always; SGLang's breakable prefill graphs (padded extend batches) when
    ``prefill_graphs``, else eager prefill (faster start-up: no prefill capture)."""
    return [
        "--model-path", model_path, "--host", "127.0.0.1", "--port", str(port),
        "--dtype", dtype, "--page-size", "16", "--context-length", "4096",
        "--max-total-tokens", "65536", "--mem-fraction-static", "0.4",
        "--max-running-requests", "32", "--cuda-graph-max-bs-decode", "16", "--enable-cache-report",
        *(() if prefill_graphs else ("--cuda-graph-backend-prefill", "disabled")),
        *extra,
    ]


@contextlib.contextmanager
def launch_gpu_server(
    model_path: str, log_dir: str, *extra: str, env: dict[str, str] | None = None, name: str = "",
    dtype: str = "float32", prefill_graphs: bool = True,
):
    port = free_port()
    argv = gpu_server_args(model_path, port, *extra, dtype=dtype, prefill_graphs=prefill_graphs)
    with launch_server_argv(argv, port, model_path, log_dir, env={**EXACT_ENV, **(env or {})}, name=name) as server:
        yield server


@contextlib.contextmanager
def launch_server_argv(argv: list[str], port: int, model_path: str, log_dir: str, env: dict[str, str] | None = None, name: str = ""):
    """``sglang.launch_server`` with exactly ``argv`` (serving on ``port``) and the plugin's models."""
    log_dir = os.environ.get("OUT") or log_dir
    log_path = os.path.join(log_dir, f"server-{name or port}.log")
    env = {**os.environ, "SGLANG_EXTERNAL_MODEL_PACKAGE": "sglang_m3.models", **(env or {})}
    with open(log_path, "w", encoding="utf-8") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "sglang.launch_server", *argv],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )
    server = RunningServer(f"http://127.0.0.1:{port}", model_path, log_path, process)
    try:
        _wait_ready(server)
        yield server
    finally:
        _stop(process)


def log_text(server: RunningServer) -> str:
    with open(server.log_path, encoding="utf-8", errors="replace") as handle:
        return handle.read()
