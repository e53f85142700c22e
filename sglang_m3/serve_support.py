"""What ``sglang-m3 serve`` needs besides SGLang: the cached tiny checkpoint and the launch line.

Kept apart from the command so tests can build the same launch lines the command runs.
"""

from __future__ import annotations

import os
import sys

TINY_MODEL_PATH = "sglang-m3:tiny"
# CPU serving defaults for the tiny model: small KV budget, float32 for exact comparisons.
TINY_CPU_ARGS = (
    "--dtype", "float32", "--max-total-tokens", "8192", "--context-length", "4096",
    "--mem-fraction-static", "0.5", "--sleep-on-idle",
    "--reasoning-parser", "minimax-m3", "--tool-call-parser", "minimax-m3",
)
# The tiny model is the only one served: SGLang then skips importing its ~200 model modules
# (tens of seconds per process on a small machine).
CPU_PLATFORM_ENV = {"SGLANG_PLATFORM": "sglang_m3_cpu", "SGLANG_EXTERNAL_MODEL_PACKAGE": "sglang_m3.models"}


def cache_dir() -> str:
    base = os.environ.get("SGLANG_M3_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "sglang-m3")
    return base


def ensure_tiny_checkpoint(seed: int = 0, log=print) -> str:
    """Build the tiny checkpoint once per seed and builder format, and reuse it afterwards."""
    from sglang_m3.tiny.checkpoint import BUILD_FORMAT, build_tiny_checkpoint

    path = os.path.join(cache_dir(), f"tiny-m3-v{BUILD_FORMAT}-seed{seed}")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    log(f"building the tiny M3 checkpoint in {path} (once; a few seconds) ...")
    build_tiny_checkpoint(path, seed=seed)
    return path


def launch_command(sglang_args: list[str]) -> list[str]:
    return [sys.executable, "-m", "sglang.launch_server", *sglang_args]
