"""GPU time per kernel of one extend step (``run_prefill``, default plan) under the torch profiler.

Random inputs, one request of ``--n`` new tokens after ``--prefix`` cached ones, M3 per-layer
geometry. Each step is profiled ``--steps`` times after a warm-up; kernels are totalled by name
and divided by the steps, beside the step's CUDA-event time and its time replayed as a CUDA graph
(no launch gaps), so the split between indexer, pair grouping, attention, merge and host launch
gaps is read off directly. ``--chunks`` profiles the same step at other block-major pass sizes.
Usage: PYTHONPATH=kernels python benchmarks/prefill_step_kernels.py (writes $OUT/prefill_step_kernels.json).
"""

import argparse
import json
import os
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(__file__))
import msa_kernel_bench as bench  # noqa: E402
from msa_kernels.api import run_prefill  # noqa: E402
from msa_kernels.plan import page_table_from_req_to_token, plan_prefill  # noqa: E402
from provenance import commit  # noqa: E402

K = 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, nargs="+", default=[8 * K, 128 * K], help="new tokens of the one request")
    parser.add_argument("--prefix", type=int, default=0, help="cached tokens before the new ones")
    parser.add_argument("--steps", type=int, default=5, help="profiled steps per shape")
    parser.add_argument("--chunks", type=int, nargs="+", default=[None],
                        help="tokens per block-major pass, one profile each (default: the plan's)")
    args = parser.parse_args()
    pool = bench.Pool(tokens=((max(args.n) + args.prefix) // K + 4) * K)
    rows = []
    for n, chunk in ((n, chunk) for n in args.n for chunk in args.chunks):
        seq = args.prefix + n
        table = page_table_from_req_to_token(pool.req_to_token([seq], seq), torch.arange(1, device="cuda"), seq, bench.BLOCK)
        sizing = {} if chunk is None else {"block_major_chunk": chunk}
        plan = plan_prefill(bench.PARAMS, table, [seq], [n], num_index_heads=bench.HKV, **sizing)
        q = torch.randn(n, bench.HQ, bench.D, device="cuda", dtype=torch.bfloat16)
        iq = torch.randn(n, bench.HKV, bench.DI, device="cuda", dtype=torch.bfloat16)

        def step():
            return run_prefill(plan, q, pool.k, pool.v, iq, pool.ik)

        step_ms = bench.bench_ms(step, min_reps=5)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        graph_ms = bench.bench_ms(graph.replay, min_reps=5)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                step()
            torch.cuda.synchronize()
        per_kernel = defaultdict(lambda: [0.0, 0])
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                per_kernel[event.name][0] += event.time_range.elapsed_us() / 1000.0
                per_kernel[event.name][1] += 1
        kernels = sorted(({"kernel": name, "ms_per_step": ms / args.steps, "launches_per_step": count / args.steps}
                          for name, (ms, count) in per_kernel.items()), key=lambda k: -k["ms_per_step"])
        row = {"N": n, "prefix": args.prefix, "block_major": plan.block_major, "chunk": plan.block_major_chunk,
               "step_ms": step_ms, "graph_ms": graph_ms,
               "kernel_ms_sum": sum(k["ms_per_step"] for k in kernels), "kernels": kernels}
        print(json.dumps({k: v for k, v in row.items() if k != "kernels"}), flush=True)
        for k in kernels[:12]:
            print(f"  {k['ms_per_step']:9.3f} ms  x{k['launches_per_step']:<6g} {k['kernel'][:90]}", flush=True)
        rows.append(row)
        del q, iq, graph
        torch.cuda.empty_cache()
    with open(os.path.join(os.environ.get("OUT", "."), "prefill_step_kernels.json"), "w") as handle:
        json.dump({"gpu": torch.cuda.get_device_name(), "commit": commit(), "rows": rows}, handle, indent=1)


if __name__ == "__main__":
    main()
