"""Fresh prefills no longer than ``topk`` blocks, where every token chooses every block it sees:
the whole step with attention tiles of several heights (1 = one token per tile, the plan's
default). A tile's union is then what each of its tokens reads, so taller tiles load each block
once for more tokens.

Usage (GPU, through the harness): ``python benchmarks/prefill_dense_tiles.py --out DIR``.
Writes ``prefill_dense_tiles.json``: per (new tokens, tile height) the median step time and the
largest difference from the output of one-token tiles.
"""

import argparse
import json
import os

import torch

import msa_kernel_bench as bench
from msa_kernels.api import run_prefill
from msa_kernels.plan import page_table_from_req_to_token, plan_prefill
from provenance import commit

K = 1024
LENGTHS = (512, 1 * K, 2 * K)  # up to topk x block_size = 2K: each token reads every visible block
HEIGHTS = (1, 2, 4, 8, 16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for prefill_dense_tiles.json")
    args = parser.parse_args()
    pool = bench.Pool(max(LENGTHS))
    rows = []
    for n in LENGTHS:
        table = page_table_from_req_to_token(pool.req_to_token([n], n), torch.arange(1, device="cuda"), n, bench.BLOCK)
        q = torch.randn(n, bench.HQ, bench.D, device="cuda", dtype=torch.bfloat16)
        iq = torch.randn(n, bench.HKV, bench.DI, device="cuda", dtype=torch.bfloat16)
        reference = None
        for height in HEIGHTS:
            plan = plan_prefill(bench.PARAMS, table, [n], [n], num_index_heads=bench.HKV, attn_tile_tokens=height)
            out, _ = run_prefill(plan, q, pool.k, pool.v, iq, pool.ik)
            reference = out.clone() if reference is None else reference
            ms = bench.bench_ms(lambda p=plan: run_prefill(p, q, pool.k, pool.v, iq, pool.ik))
            rows.append({"n": n, "attn_tile_tokens": height, "ms": ms,
                         "max_abs_diff_vs_one_token_tiles": (out.float() - reference.float()).abs().max().item()})
            print(json.dumps(rows[-1]), flush=True)
    os.makedirs(args.out, exist_ok=True)
    meta = {"gpu": torch.cuda.get_device_name(), "commit": commit()}
    with open(os.path.join(args.out, "prefill_dense_tiles.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
