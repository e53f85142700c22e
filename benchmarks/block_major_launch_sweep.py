"""Launch sweep of the KV-block-major prefill attention alone (GPU): tile rows, warps, pipeline
stages and persistent programs per SM.

Random inputs, one request of ``--n`` new tokens, the selection computed once; each variant runs
``api._attention_block_major`` with the module's launch settings replaced, is checked against the
shipped settings' output, and is timed in alternating rounds (every variant once per round, a
CUDA-event median each), so drift of the GPU falls on all of them.
Usage: PYTHONPATH=kernels python benchmarks/block_major_launch_sweep.py (writes $OUT/block_major_launch_sweep.json).
"""

import argparse
import dataclasses
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import msa_kernel_bench as bench  # noqa: E402
from msa_kernels import api  # noqa: E402
from msa_kernels.plan import page_table_from_req_to_token, plan_prefill  # noqa: E402
from provenance import commit  # noqa: E402

K = 1024
ROUNDS = 3
SETTINGS = ("_BLOCK_MAJOR_ROWS", "_BLOCK_MAJOR_WARPS", "_BLOCK_MAJOR_STAGES")
# (rows, warps, stages, programs per SM); the first is the shipped launch
VARIANTS = [
    (64, 4, 2, 2),
    (64, 4, 1, 2),
    (64, 4, 3, 2),
    (64, 4, 2, 3),
    (128, 8, 2, 1),
    (32, 4, 2, 4),
]


def run_variant(variant, plan, q, pool, sel, out):
    *launch, per_sm = variant
    saved = {name: getattr(api, name) for name in SETTINGS}
    for name, value in zip(SETTINGS, launch):
        setattr(api, name, value)
    try:
        sized = dataclasses.replace(plan, block_major_programs=per_sm * torch.cuda.get_device_properties(0).multi_processor_count)
        api._attention_block_major(sized, q, pool.k, pool.v, sel, out, 0.088, bench.BLOCK)
    finally:
        for name, value in saved.items():
            setattr(api, name, value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, nargs="+", default=[8 * K, 32 * K, 128 * K], help="new tokens of the one request")
    args = parser.parse_args()
    pool = bench.Pool(tokens=(max(args.n) // K + 4) * K)
    rows = []
    for n in args.n:
        table = page_table_from_req_to_token(pool.req_to_token([n], n), torch.arange(1, device="cuda"), n, bench.BLOCK)
        plan = plan_prefill(bench.PARAMS, table, [n], [n], num_index_heads=bench.HKV, block_major=True)
        q = torch.randn(n, bench.HQ, bench.D, device="cuda", dtype=torch.bfloat16)
        iq = torch.randn(n, bench.HKV, bench.DI, device="cuda", dtype=torch.bfloat16)
        sel = api.prefill_select(plan, iq, pool.ik)
        outs = [torch.empty_like(q) for _ in VARIANTS]
        for variant, out in zip(VARIANTS, outs):
            run_variant(variant, plan, q, pool, sel, out)
        ms = [[] for _ in VARIANTS]
        for _ in range(ROUNDS):
            for i, (variant, out) in enumerate(zip(VARIANTS, outs)):
                ms[i].append(bench.bench_ms(lambda v=variant, o=out: run_variant(v, plan, q, pool, sel, o), min_reps=3, budget_ms=300))
        for (r, w, st, per_sm), out, times in zip(VARIANTS, outs, ms):
            row = {"N": n, "rows": r, "warps": w, "stages": st, "programs_per_sm": per_sm,
                   "ms": times, "median_ms": statistics.median(times),
                   "max_abs_diff_vs_shipped": (out.float() - outs[0].float()).abs().max().item()}
            print(json.dumps(row), flush=True)
            rows.append(row)
        del q, iq, sel, outs
        torch.cuda.empty_cache()
    with open(os.path.join(os.environ.get("OUT", "."), "block_major_launch_sweep.json"), "w") as handle:
        json.dump({"gpu": torch.cuda.get_device_name(), "commit": commit(), "rows": rows}, handle, indent=1)


if __name__ == "__main__":
    main()
