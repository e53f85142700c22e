"""Shared machinery of the ``sgl_kernel`` stand-in: named refusals and a record of what ran.

SGLang imports about a hundred names from the compiled ``sgl_kernel`` wheel (1.2 GB, built for
another torch), most of them only at import time on CUDA. The stand-in must let those imports
succeed, must never compute something silently wrong, and must leave a trace of every op that
did run through it, so that GPU results can say which kernels were not SGLang's own.
"""

from __future__ import annotations

import logging
import os
import threading

logger = logging.getLogger("sgl_kernel.standin")
_ran: set[str] = set()
_lock = threading.Lock()
LOG_ENV = "M3_GPU_STANDIN_LOG"


class StandInMissing(NotImplementedError):
    """Raised when SGLang calls an ``sgl_kernel`` op the GPU harness does not implement."""


def missing(qualname: str):
    """A callable that refuses, naming ``qualname``: the op exists for imports only."""

    def refuse(*args, **kwargs):
        raise StandInMissing(
            f"{qualname} was called, but the GPU harness's sgl_kernel stand-in does not implement it "
            "(scripts/gpu/standins/sgl_kernel); pick a path that avoids it or implement it there"
        )

    refuse.__name__ = qualname.rsplit(".", 1)[-1]
    refuse.__qualname__ = qualname
    refuse.__sgl_kernel_standin__ = "missing"
    return refuse


def note_ran(name: str) -> None:
    """Record (once per process) that the stand-in implementation of ``name`` ran."""
    if name in _ran:
        return
    with _lock:
        if name in _ran:
            return
        _ran.add(name)
    logger.warning("sgl_kernel stand-in ran: %s", name)
    path = os.environ.get(LOG_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(f"{os.getpid()} {name}\n")


def ran() -> frozenset[str]:
    return frozenset(_ran)


def stub_module(module_globals: dict, qualprefix: str, names: tuple[str, ...]) -> None:
    """Fill a stand-in module with refusing callables for ``names``."""
    for name in names:
        module_globals[name] = missing(f"{qualprefix}.{name}")
