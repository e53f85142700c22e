"""The extend indexer (index scan + top-k, ``prefill_select``) over its plan's two free choices (GPU).

``plan_prefill`` picks the indexer tile height (``index_rows``: 128 (token, index head) rows) and,
for a short chunk after a long prefix, how many programs share each tile's blocks
(``index_splits``, from ``_index_splits_for``); both were chosen on an H100. The selection does not
depend on either (each row keeps the top-k of every block it sees), so this times each pair on
random inputs and checks that it chose what the default plan chose (rows whose block sets differ
are counted; random scores rarely tie). One request per shape, M3's widths (4 index heads at
TP1; the environment's ``HKV=2``: a TP2 rank's), CUDA events with the kernel benchmark's timer.

    PYTHONPATH=kernels python benchmarks/prefill_index_sweep.py --out sweep.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import msa_kernel_bench as bench  # noqa: E402
from msa_kernels.api import prefill_select  # noqa: E402
from msa_kernels.plan import page_table_from_req_to_token, plan_prefill  # noqa: E402
from provenance import commit  # noqa: E402

SHAPES = ((4096, 126976), (8192, 122880), (8192, 0), (16384, 16384))  # (new tokens, prefix)
INDEX_ROWS = (64, 128, 256)
SPLITS = (None, 1, 2, 3, 4, 5, 6, 8, 10, 13, 16)  # None: the plan's own choice


def sweep_shape(pool: bench.Pool, n: int, prefix: int) -> dict:
    total = n + prefix
    table = page_table_from_req_to_token(pool.req_to_token([total], total), torch.arange(1, device="cuda"), total, bench.BLOCK)
    iq = torch.randn(n, bench.HKV, bench.DI, device="cuda", dtype=torch.bfloat16)
    default = plan_prefill(bench.PARAMS, table, [total], [n], num_index_heads=bench.HKV)
    want = prefill_select(default, iq, pool.ik).sort(dim=-1).values
    row = {"N": n, "prefix": prefix, "hkv": bench.HKV, "default_splits": default.index_splits, "ms": {}, "rows_differing": {}}
    for rows in INDEX_ROWS:
        for splits in SPLITS:
            if splits is not None and splits > 1 and prefix == 0 and n >= 8192:
                continue  # tiles alone fill the GPU there; splitting only adds a merge
            plan = plan_prefill(bench.PARAMS, table, [total], [n], num_index_heads=bench.HKV, index_rows=rows, index_splits=splits)
            name = f"rows{rows}_splits{plan.index_splits}{'_auto' if splits is None else ''}"
            got = prefill_select(plan, iq, pool.ik).sort(dim=-1).values
            row["rows_differing"][name] = int((got != want).any(dim=-1).sum())
            row["ms"][name] = bench.bench_ms(lambda: prefill_select(plan, iq, pool.ik))
    best = min(row["ms"], key=row["ms"].get)
    print(f"N {n} prefix {prefix}: default {row['ms'][f'rows128_splits{default.index_splits}_auto']:.3f} ms, "
          f"best {best} {row['ms'][best]:.3f} ms", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--commit", default=commit(), help="commit of the benchmarked code")
    args = parser.parse_args()
    if os.environ.get("HKV"):
        bench.HKV = int(os.environ["HKV"])
    torch.manual_seed(0)
    pool = bench.Pool(1 << 18)
    result = {"gpu": torch.cuda.get_device_name(), "commit": args.commit, "hkv": bench.HKV, "rows": [sweep_shape(pool, n, p) for n, p in SHAPES]}
    with open(args.out, "w", encoding="utf-8") as handle:
        json.dump(result, handle, indent=1)


if __name__ == "__main__":
    main()
