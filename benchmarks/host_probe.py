"""How fast and how busy the benchmark's host is, recorded beside GPU results.

At concurrency 1 a decode step of the mid-size model costs about as much host time (SGLang's
scheduler, in Python) as GPU time, so the same commit on the same GPU model measured 1.74 ms per
token on one lent machine and 2.38 ms on another. A result that names its host's single-thread
speed and load lets a reader tell a slower host from a slower commit.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from typing import Callable, TypeVar

T = TypeVar("T")

#: iterations of the probe's Python loop (a fixed amount of work, so its time compares across hosts)
PROBE_ITERATIONS = 200_000


def python_loop_ms(iterations: int = PROBE_ITERATIONS) -> float:
    """Wall time of a fixed pure-Python workload (dict writes, reads and attribute lookups, the
    kind of work a scheduler step does), in milliseconds."""

    class Request:
        __slots__ = ("rid", "length")

        def __init__(self, rid: int):
            self.rid, self.length = rid, rid & 1023

    table: dict[int, Request] = {}
    start = time.perf_counter()
    total = 0
    for i in range(iterations):
        table[i & 4095] = Request(i)
        total += table[(i * 7) & 4095].length if (i * 7) & 4095 in table else 0
    return 1000.0 * (time.perf_counter() - start)


def probed(run: Callable[[], T]) -> tuple[T, float]:
    """``run()``'s result and the time of one :func:`python_loop_ms` taken just before it.

    A probe before each server starts is not enough: on one H200 lease the loop took 71-77 ms
    before one server and 131-157 ms before the next, 20 minutes later, and a server's lone
    requests went from 1.95 to 2.62 ms per token within its own measurement. A probe beside each
    lone request shows which host speed each one met."""
    loop_ms = python_loop_ms()
    return run(), loop_ms


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def host_probe(repeats: int = 5) -> dict:
    """The host's CPU model and count, its 1-minute load average, and the median of ``repeats``
    runs of :func:`python_loop_ms`."""
    runs = [python_loop_ms() for _ in range(repeats)]
    return {
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "python_loop_ms": statistics.median(runs),
        "python_loop_ms_runs": runs,
    }
