"""Where a long prompt's prefill spends its time outside the GPU kernels, on a running server.

The TTFT of several 32K prompts in a row (the first one compiles this length's kernels), then one
32K prefill under SGLang's profiler with host (CPU, Python stacks) and GPU activity: the host
duration of every attention op, the GPU's idle gaps, and the host work that ran inside them (the
innermost Python function at each moment, and the callers it ran under), then more TTFTs.
``--env KEY=VALUE`` starts the server with a switch set (e.g. ``SGLANG_M3_DENSE_PREFIX_SPLIT=0``),
``--server-arg`` with a flag (e.g. ``--server-arg=--warmups --server-arg=m3_long_prompt``).
The Python tracer slows the host several-fold, so gap sizes rank the host work; TTFTs, measured
without the profiler, say what it costs. The trace also gives the request's window in the
scheduler (its arrival to the first kernel, the GPU span, the kernel time) and the per-kernel
table; two floors close the account: a 16-token prompt's TTFT and a repeated 32K prompt's (a radix
hit), both without the profiler. Results: ``benchmarks/results/prefill_host_h100/``.

    scripts/gpu/run.sh exec python benchmarks/prefill_host_probe.py --out $OUT --tp 2 --ep 2
"""

from __future__ import annotations

import argparse
import bisect
import glob
import json
import os
import re
import sys
import tempfile
import time

import requests

sys.path.insert(0, os.path.dirname(__file__))
from e2e_gpu import IMPLS, LONG_CONTEXT_PROMPT, gpu_name, start_server, stop_server, warm_up  # noqa: E402
from provenance import commit  # noqa: E402
from midsize_m3 import write_midsize_checkpoint  # noqa: E402
from serving_client import random_prompt, stream_generate  # noqa: E402
from trace_summary import gpu_gaps, idle_gaps, kernel_summary, load_events, timed_kernels  # noqa: E402

#: host ops worth listing one by one (the attention calls of the dense layer and their neighbours)
WATCHED_OPS = ("cudnn", "scaled_dot_product", "flash")


def ttfts_ms(base_url: str, seeds, count: int) -> list[float]:
    return [round(1e3 * stream_generate(base_url, random_prompt(LONG_CONTEXT_PROMPT, next(seeds)), 1).ttft_s, 1) for _ in range(count)]


def floor_ttfts_ms(base_url: str, seeds, count: int) -> dict:
    """TTFTs that hold a long prompt's cost outside its prefill: a 16-token prompt (the fixed path
    from HTTP to the first streamed token) and one 32K prompt sent again (a radix hit: its 32K ids
    still cross HTTP, the tokenizer manager, the scheduler's prefix match, but one token is computed)."""
    short = [round(1e3 * stream_generate(base_url, random_prompt(16, next(seeds)), 1).ttft_s, 1) for _ in range(count)]
    repeated = random_prompt(LONG_CONTEXT_PROMPT, next(seeds))
    stream_generate(base_url, repeated, 1)
    cached = [round(1e3 * stream_generate(base_url, repeated, 1).ttft_s, 1) for _ in range(count)]
    return {"ttft_16_ms": short, "ttft_32k_cached_ms": cached}


def request_window(events: list[dict], top: int = 15) -> dict:
    """The profiled request's path through the scheduler, from the trace: the host time from the
    scheduler's ``handle_generate_request`` to the prefill's first kernel (and the host work in it,
    inclusive, by function), then the GPU span to the last kernel and the kernel time inside it."""
    host = [e for e in events if e.get("ph") == "X" and e.get("cat") == "python_function"]
    received = [float(e["ts"]) for e in host if e["name"].endswith("handle_generate_request")]
    if not received:
        return {"error": "no handle_generate_request in the trace (profiled without Python stacks?)"}
    t_recv = min(received)
    kernels = [k for k in timed_kernels(events) if k[0] >= t_recv]
    if not kernels:
        return {"error": "no kernel after the request reached the scheduler"}
    t_first, t_last = kernels[0][0], max(end for _, end, _ in kernels)
    before: dict[str, float] = {}
    for event in host:
        begin, finish = float(event["ts"]), float(event["ts"]) + float(event.get("dur", 0.0))
        if begin < t_first and finish > t_recv and finish - begin < t_first - t_recv:
            before[event["name"]] = before.get(event["name"], 0.0) + min(finish, t_first) - max(begin, t_recv)
    return {
        "recv_to_first_kernel_ms": round((t_first - t_recv) / 1e3, 3),
        "gpu_span_ms": round((t_last - t_first) / 1e3, 3),
        "kernel_ms": round(sum(end - start for start, end, _ in kernels) / 1e3, 3),
        "host_before_first_kernel": [{"name": name, "ms": round(us / 1e3, 3)}
                                     for name, us in sorted(before.items(), key=lambda item: -item[1])[:top]],
    }


def host_work_in_gaps(events: list[dict], min_gap_us: float = 500.0, top: int = 25, longest_us: float = 50e3) -> dict:
    """What the host ran while the GPU sat idle, by name, clipped to GPU gaps of at least ``min_gap_us``.

    Host events are Python functions where the trace has them, else aten ops. ``self``: the
    innermost event at each moment (where the time went); ``inclusive``: every event shorter than
    ``longest_us`` (which callers the gaps fall in, without the scheduler loop's own frames).
    """
    gaps = [(start, end) for start, end, _, _ in gpu_gaps(events, min_gap_us)]
    host = [e for e in events if e.get("ph") == "X" and e.get("cat") == "python_function"] or \
           [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    gap_ends = [end for _, end in gaps]
    by_gap: list[list[tuple[float, float, str]]] = [[] for _ in gaps]
    for event in host:
        begin, finish = float(event["ts"]), float(event["ts"]) + float(event.get("dur", 0.0))
        index = bisect.bisect_right(gap_ends, begin)  # the first gap that ends after the event begins
        while index < len(gaps) and gaps[index][0] < finish:
            by_gap[index].append((begin, finish, event["name"]))
            index += 1
    own: dict[str, float] = {}
    inclusive: dict[str, float] = {}
    for (gap_start, gap_end), covering in zip(gaps, by_gap):
        for begin, finish, name in covering:
            if finish - begin < longest_us:
                inclusive[name] = inclusive.get(name, 0.0) + min(finish, gap_end) - max(begin, gap_start)
        cuts = sorted({gap_start, gap_end, *(t for span in covering for t in span[:2] if gap_start < t < gap_end)})
        for left, right in zip(cuts, cuts[1:]):
            middle = (left + right) / 2
            inner = [span for span in covering if span[0] <= middle < span[1]]
            if inner:
                name = max(inner, key=lambda span: (span[0], -span[1]))[2]
                own[name] = own.get(name, 0.0) + right - left

    def ranked(totals: dict[str, float]) -> list[dict]:
        return [{"name": name, "ms_in_gaps": round(us / 1e3, 3)} for name, us in sorted(totals.items(), key=lambda item: -item[1])[:top]]

    return {"gaps": len(gaps), "gap_ms": round(sum(b - a for a, b in gaps) / 1e3, 3), "self": ranked(own), "inclusive": ranked(inclusive)}


def profiled_prefill(base_url: str, out_dir: str, label: str, chunks: int, seed: int) -> dict:
    """One 32K prompt's prefill under SGLang's profiler with CPU and GPU activity."""
    trace_dir = os.path.join(out_dir, f"probe-{label}")
    answer = requests.post(f"{base_url}/start_profile", json={"output_dir": trace_dir, "num_steps": chunks, "activities": ["CPU", "GPU"], "with_stack": True},
                           timeout=60)
    answer.raise_for_status()
    # more output tokens than one: steps must keep coming until the profiler's count is reached
    stream_generate(base_url, random_prompt(LONG_CONTEXT_PROMPT, seed), 16)
    deadline = time.time() + 120
    while time.time() < deadline:
        traces = sorted(glob.glob(os.path.join(trace_dir, "*TP-0*.trace.json*"))) or sorted(glob.glob(os.path.join(trace_dir, "*.trace.json*")))
        if traces:
            time.sleep(3)
            events = load_events(traces[0])
            ops = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op" and any(w in e.get("name", "") for w in WATCHED_OPS)]
            ops.sort(key=lambda e: e["ts"])
            t0 = min(float(e["ts"]) for e in events if e.get("ph") == "X" and "ts" in e)
            return {
                "trace": os.path.basename(traces[0]),
                "request_window": request_window(events),
                "kernels": kernel_summary(events, 1, top=30),
                "watched_host_ops": [{"name": e["name"], "at_ms": round((float(e["ts"]) - t0) / 1e3, 2), "host_ms": round(float(e["dur"]) / 1e3, 3)}
                                     for e in ops],
                "idle": idle_gaps(events),
                "host_work_in_gaps": host_work_in_gaps(events),
            }
        time.sleep(1)
    raise TimeoutError(f"no trace under {trace_dir}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--impl", choices=IMPLS, default="ours")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="set for the server (repeatable)")
    parser.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                        help="added to the server's command line (repeatable; write --server-arg=--flag for a flag)")
    parser.add_argument("--ttfts", type=int, default=4, help="32K TTFTs before and after the profiled prefill")
    args = parser.parse_args(argv)
    env = dict(item.split("=", 1) for item in args.env)
    label = re.sub(r"[^A-Za-z0-9_.-]", "_", "-".join([args.impl, *(f"{k}={v}" for k, v in env.items()), *(a.lstrip("-") for a in args.server_arg)]))
    os.makedirs(args.out, exist_ok=True)
    model_dir = write_midsize_checkpoint(tempfile.mkdtemp(prefix="m3-midsize-"), 1, 3)
    result = {"commit": commit(), "gpu": gpu_name(), "impl": args.impl, "tp": args.tp, "ep": args.ep, "env": env, "server_args": args.server_arg}
    process, base_url, startup_s, _ = start_server(args.impl, model_dir, args.out, args.tp, args.ep, label=label,
                                                   extra_args=tuple(args.server_arg), env=env)
    result["startup_s"] = round(startup_s, 1)
    try:
        chunks = -(-LONG_CONTEXT_PROMPT // (requests.get(f"{base_url}/get_server_info", timeout=30).json().get("chunked_prefill_size") or LONG_CONTEXT_PROMPT))
        seeds = iter(range(10**6))
        warm_up(base_url, seeds)
        result["ttft_32k_ms_before"] = ttfts_ms(base_url, seeds, args.ttfts)
        print(f"[{label}] 32K TTFT ms: {result['ttft_32k_ms_before']}", flush=True)
        result["profiled"] = profiled_prefill(base_url, args.out, label, chunks, 10**7)
        for op in result["profiled"]["watched_host_ops"]:
            print(f"  host {op['host_ms']:8.3f} ms at {op['at_ms']:8.2f} ms  {op['name']}", flush=True)
        for gap in result["profiled"]["idle"]["gaps"][:6]:
            print(f"  idle {gap['us_total'] / 1e3:7.1f} ms in {gap['count']} gaps: {gap['after'][:50]} -> {gap['before'][:50]}", flush=True)
        in_gaps = result["profiled"]["host_work_in_gaps"]
        print(f"  {in_gaps['gaps']} GPU gaps of 0.5 ms or more, {in_gaps['gap_ms']:.1f} ms in all; host work inside them:", flush=True)
        for kind in ("self", "inclusive"):
            for work in in_gaps[kind][:15]:
                print(f"  {kind:9s} {work['ms_in_gaps']:7.2f} ms  {work['name'][:110]}", flush=True)
        window = result["profiled"]["request_window"]
        print(f"  request window (under the Python tracer): {json.dumps({k: v for k, v in window.items() if k != 'host_before_first_kernel'})}", flush=True)
        for work in window.get("host_before_first_kernel", [])[:10]:
            print(f"  before the first kernel {work['ms']:7.2f} ms  {work['name'][:110]}", flush=True)
        result["ttft_32k_ms_after"] = ttfts_ms(base_url, seeds, args.ttfts)
        print(f"[{label}] 32K TTFT ms after: {result['ttft_32k_ms_after']}", flush=True)
        result["floors"] = floor_ttfts_ms(base_url, seeds, args.ttfts)
        print(f"[{label}] floors: {result['floors']}", flush=True)
    finally:
        stop_server(process)
        with open(os.path.join(args.out, f"prefill_host_probe_{label}_tp{args.tp}_ep{args.ep}.json"), "w") as handle:
            json.dump(result, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
