"""The commit a benchmark's numbers come from, recorded in every results file.

A device run works on a copy of the working tree without its git history, so whoever starts it
names the commit in ``M3_COMMIT``; a run inside a checkout falls back to that checkout's HEAD.
"""

from __future__ import annotations

import os
import subprocess


def commit() -> str:
    """``M3_COMMIT`` when set, else this checkout's short HEAD, else ``"unknown"``."""
    if os.environ.get("M3_COMMIT"):
        return os.environ["M3_COMMIT"]
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True, cwd=os.path.dirname(os.path.abspath(__file__))
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
