"""Per-kernel GPU time of a torch-profiler trace (what SGLang's ``/start_profile`` writes).

A decode step of the mid-size model is a few hundred kernels; comparing two servers' steps kernel
by kernel shows where one spends more time than the other. This reads a Chrome-trace file
(``.json`` or ``.json.gz``), keeps the GPU kernel events (``cat`` "kernel", which CUPTI also
reports for kernels replayed inside CUDA graphs) and totals their durations by kernel name.

    python benchmarks/trace_summary.py TRACE [--steps N] [--top 40] [--step-kernel NAME]

With ``--step-kernel`` (a kernel that runs once at the start of every step, e.g. the embedding's
``_vocab_parallel_embedding_kernel``) it also reports, per step, how long the step's collectives
(NCCL kernels) ran: under tensor parallelism a rank that starts its step early waits inside its
first all-reduce for the others, so that kernel's time is the skew between the ranks' hosts, not
communication.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
from collections import defaultdict


def load_events(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as handle:
        trace = json.load(handle)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def kernel_summary(events: list[dict], steps: int = 1, top: int = 40) -> dict:
    """Total, per-step and per-call GPU time by kernel name, largest first (microseconds)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    totals: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    starts, ends = [], []
    for event in events:
        if event.get("ph") == "X" and event.get("cat") == "kernel":
            totals[event["name"]] += float(event.get("dur", 0.0))
            counts[event["name"]] += 1
            if "ts" in event:
                starts.append(float(event["ts"]))
                ends.append(float(event["ts"]) + float(event.get("dur", 0.0)))
    ranked = sorted(totals, key=totals.get, reverse=True)
    all_us = sum(totals.values())
    # First kernel start to last kernel end: beside the kernel total it shows how long the GPU
    # sat idle between kernels (host-side work the step waited for).
    span_us = max(ends) - min(starts) if starts else 0.0
    return {
        "kernel_us_total": all_us,
        "kernel_us_per_step": all_us / steps,
        "span_us_per_step": span_us / steps,
        "launches_per_step": sum(counts.values()) / steps,
        "kernels": [
            {"name": name, "us_per_step": totals[name] / steps, "calls_per_step": counts[name] / steps,
             "us_per_call": totals[name] / counts[name], "share": totals[name] / all_us if all_us else 0.0}
            for name in ranked[:top]
        ],
    }


def timed_kernels(events: list[dict]) -> list[tuple[float, float, str]]:
    """``(start, end, name)`` of every GPU kernel with a start time, in time order (microseconds)."""
    return sorted(
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), e["name"])
        for e in events if e.get("ph") == "X" and e.get("cat") == "kernel" and "ts" in e
    )


def gpu_gaps(events: list[dict], min_us: float = 20.0) -> list[tuple[float, float, str, str]]:
    """``(start, end, kernel before, kernel after)`` of every stretch of at least ``min_us`` in
    which no kernel ran (kernels overlapping in time count as busy), in time order."""
    gaps = []
    busy_until, previous = None, None
    for start, end, name in timed_kernels(events):
        if busy_until is not None and start - busy_until >= min_us:
            gaps.append((busy_until, start, previous, name))
        if busy_until is None or end > busy_until:
            busy_until, previous = end, name
    return gaps


def idle_gaps(events: list[dict], min_us: float = 20.0, top: int = 25) -> dict:
    """Where the GPU sat idle: :func:`gpu_gaps` grouped by the kernels on either side. A gap
    before the same kernel in every layer points at host work (or a host sync) in the code that
    launches it."""
    groups: dict[tuple[str, str], list[float]] = defaultdict(list)
    for start, end, before, after in gpu_gaps(events, min_us):
        groups[(before[:80], after[:80])].append(end - start)
    ranked = sorted(groups.items(), key=lambda item: -sum(item[1]))
    return {
        "min_gap_us": min_us,
        "idle_us_total": sum(sum(gaps) for gaps in groups.values()),
        "gaps": [{"after": after, "before": before, "count": len(gaps), "us_total": sum(gaps), "us_max": max(gaps)}
                 for (after, before), gaps in ranked[:top]],
    }


#: trace categories of host-side launch calls (CUPTI's runtime and driver API records)
API_CATEGORIES = ("cuda_runtime", "cuda_driver")
#: GPU work that a step issues from the host one call at a time when it is not a kernel
COPY_CATEGORIES = ("gpu_memcpy", "gpu_memset")


def launch_origins(events: list[dict], steps: int = 1, top: int = 25) -> dict:
    """Which GPU work came from CUDA-graph replays and which the host launched one call at a time.

    CUPTI gives a kernel the correlation id of the host call that issued it: one
    ``cudaGraphLaunch`` for every kernel of a replayed graph, a ``cudaLaunchKernel`` /
    ``cuLaunchKernel...`` per eager kernel. Eager launches (and copies, memsets) cost the host
    a call each at every step, which is where a graphed step's host time goes beyond the replay.
    Kernels whose host call the trace does not hold count as ``unmatched``.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    api = {event["args"]["correlation"]: event["name"] for event in events
           if event.get("ph") == "X" and event.get("cat") in API_CATEGORIES and "correlation" in event.get("args", {})}
    counts = {"graph": 0, "eager": 0, "unmatched": 0}
    eager: dict[str, list[float]] = defaultdict(list)
    for event in events:
        if event.get("ph") != "X" or event.get("cat") not in ("kernel", *COPY_CATEGORIES):
            continue
        call = api.get(event.get("args", {}).get("correlation"))
        origin = "unmatched" if call is None else "graph" if "GraphLaunch" in call else "eager"
        counts[origin] += 1
        if origin == "eager":
            eager[event["name"]].append(float(event.get("dur", 0.0)))
    ranked = sorted(eager, key=lambda name: -len(eager[name]))
    return {
        **{f"{origin}_per_step": count / steps for origin, count in counts.items()},
        "eager": [{"name": name[:100], "calls_per_step": len(eager[name]) / steps, "us_per_step": sum(eager[name]) / steps}
                  for name in ranked[:top]],
    }


def collective_waits(events: list[dict], step_kernel: str, collective: str = "nccl") -> dict:
    """Per step (from one ``step_kernel`` launch to the next): the first kernel whose name holds
    ``collective`` and the later ones, in microseconds, with their medians."""
    steps: list[list[float]] = []
    for start, end, name in timed_kernels(events):
        if step_kernel in name:
            steps.append([])
        elif steps and collective.lower() in name.lower():
            steps[-1].append(end - start)
    steps = [step for step in steps if step]
    if not steps:
        raise ValueError(f"no step starting with {step_kernel!r} holds a {collective!r} kernel")
    first = [step[0] for step in steps]
    rest = [duration for step in steps for duration in step[1:]]
    return {
        "step_kernel": step_kernel,
        "steps": len(steps),
        "first_us": first,
        "first_us_median": statistics.median(first),
        "later_us_median": statistics.median(rest) if rest else None,
        "later_per_step": len(rest) / len(steps),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace")
    parser.add_argument("--steps", type=int, default=1, help="forward steps the trace covers (divides the totals)")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--step-kernel", help="a kernel launched once at the start of each step: adds per-step collective times")
    args = parser.parse_args(argv)
    events = load_events(args.trace)
    summary = {**kernel_summary(events, args.steps, args.top), "idle": idle_gaps(events), "origins": launch_origins(events, args.steps)}
    if args.step_kernel:
        summary["collectives"] = collective_waits(events, args.step_kernel)
    json.dump(summary, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
