"""Per-process accounting of Python's garbage collector, for host-time diagnosis on the GPU harness.

``decode_host_profile.py --gc-stats`` puts this folder first on the server's ``PYTHONPATH``, so
every Python process of the server imports it at start-up. A ``gc.callbacks`` entry adds up the
collections and their wall time per generation; at most five times a second (from inside a callback)
the totals are written to ``$M3_GC_STATS_DIR/gc-<pid>.json`` with the process's name, so the
tool can difference two snapshots taken around a decode phase. SGLang's own
``--gc-warning-threshold-secs`` logs only single long collections, not the many short ones.
It shadows the interpreter's own ``sitecustomize`` while it is on the path (the device image's
is Debian's, which only installs an error-report hook).
"""

import gc
import json
import os
import time

_DIR = os.environ.get("M3_GC_STATS_DIR")


def _process_name() -> str:
    try:
        with open("/proc/self/cmdline", "rb") as handle:
            return handle.read().replace(b"\0", b" ").decode(errors="replace").strip()[:200]
    except OSError:
        return "?"


def _install(directory: str) -> None:
    path = os.path.join(directory, f"gc-{os.getpid()}.json")
    totals = {"collections": [0, 0, 0], "seconds": [0.0, 0.0, 0.0], "collected": [0, 0, 0]}
    state = {"start": 0.0, "written": 0.0}

    def dump() -> None:
        snapshot = {"pid": os.getpid(), "name": _process_name(), "time": time.time(), "counts": gc.get_count(), **totals}
        temporary = f"{path}.tmp"
        with open(temporary, "w", encoding="utf-8") as handle:
            json.dump(snapshot, handle)
        os.replace(temporary, path)

    def callback(phase: str, info: dict) -> None:
        if phase == "start":
            state["start"] = time.perf_counter()
            return
        generation = info["generation"]
        totals["collections"][generation] += 1
        totals["seconds"][generation] += time.perf_counter() - state["start"]
        totals["collected"][generation] += info.get("collected", 0)
        now = time.monotonic()
        if now - state["written"] >= 0.2:
            state["written"] = now
            dump()

    gc.callbacks.append(callback)


if _DIR:
    os.makedirs(_DIR, exist_ok=True)
    _install(_DIR)
