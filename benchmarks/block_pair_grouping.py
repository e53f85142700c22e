"""The block-major pair grouping alone (GPU): the counting sort against a torch.sort of the same keys.

One pass of ``--pass-tokens`` new tokens (the last of a prompt of ``--context`` tokens), random
selections from the indexer over random keys, M3 per-layer geometry. ``group_pairs_ms`` is the
whole grouping as the attention consumes it (keys, counts, scan, scatter, tile keys);
``torch_sort_ms`` sorts the pass's int32 keys with their indices, the first step of the sort-based
grouping it replaced (0.4-0.6 ms per pass with its tile tables, benchmarks/KERNEL_NOTES.md v8), so
it is a floor for that form. Usage: PYTHONPATH=kernels python benchmarks/block_pair_grouping.py
(writes $OUT/block_pair_grouping.json).
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import msa_kernel_bench as bench  # noqa: E402
from msa_kernels import api  # noqa: E402
from msa_kernels.plan import BLOCK_MAJOR_CHUNK_TOKENS, page_table_from_req_to_token, plan_prefill  # noqa: E402
from provenance import commit  # noqa: E402

K = 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, nargs="+", default=[16 * K, 64 * K, 128 * K], help="tokens of the prompt")
    parser.add_argument("--pass-tokens", type=int, default=BLOCK_MAJOR_CHUNK_TOKENS, help="new tokens of the timed pass")
    args = parser.parse_args()
    pool = bench.Pool(tokens=(max(args.context) // K + 4) * K)
    num_pages = pool.k.shape[0] // bench.BLOCK
    pairs_per_tile = max(1, api._BLOCK_MAJOR_ROWS // api._pow2(bench.HQ // bench.HKV))
    rows = []
    for context in args.context:
        n = min(args.pass_tokens, context)
        table = page_table_from_req_to_token(pool.req_to_token([context], context), torch.arange(1, device="cuda"), context, bench.BLOCK)
        plan = plan_prefill(bench.PARAMS, table, [context], [n], num_index_heads=bench.HKV, block_major=True)
        iq = torch.randn(n, bench.HKV, bench.DI, device="cuda", dtype=torch.bfloat16)
        selected = api.prefill_select(plan, iq, pool.ik)

        def group():
            return api._group_pairs(plan.page_table, plan.token_req, plan.token_pos, selected, 0, n, num_pages,
                                    bench.BLOCK, pairs_per_tile)

        grouped = group()
        keys = torch.randint(0, bench.HKV * num_pages, (n * bench.HKV * bench.TOPK,), device="cuda", dtype=torch.int32)
        row = {
            "context": context, "pass_tokens": n, "pairs": keys.numel(), "tiles": int(grouped.num_tiles.item()),
            "group_pairs_ms": bench.bench_ms(group, min_reps=10),
            "torch_sort_ms": bench.bench_ms(lambda: torch.sort(keys, stable=True), min_reps=10),
        }
        print(json.dumps(row), flush=True)
        rows.append(row)
    meta = {"gpu": torch.cuda.get_device_name(), "commit": commit(), "num_pages": num_pages}
    with open(os.path.join(os.environ.get("OUT", "."), "block_pair_grouping.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
