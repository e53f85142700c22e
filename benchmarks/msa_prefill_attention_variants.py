"""The query-major prefill attention (GPU): the general MSA attention kernel against the extend
kernel of one-token tiles, attention alone (selection computed once), random inputs, one request.

- ``general``: ``sparse_attention_kernel`` as ``api._attention`` launches it for a prefill plan
  (4 warps, 2 stages): every block's K and V through masked pointer loads;
- ``one_token_tiles_s{S}_w{W}``: ``prefill_attention_kernel`` (``api._attention_one_token_tiles``,
  what extend batches run), the token's older blocks by tensor descriptor (TMA) and unmasked,
  ``S`` pipeline stages, ``W`` warps (the shipped setting is s3 w4).

Every variant's output is compared with the general kernel's before timing. ``HKV`` sets the KV
heads of a rank (4 at TP1, 2 at TP2; query heads are 16 per KV head).
Usage: PYTHONPATH=kernels python benchmarks/msa_prefill_attention_variants.py (writes $OUT/
prefill_attention_variants_hkv{HKV}.json).

The first run (c4cfdba, ``results/msa_prefill_attention_h200/``) also swept the general kernel's
warps and stages (2 stages and 4 warps were fastest, 1 stage 1.4x slower) and a form of the
one-token kernel with pointer loads for the older blocks (within 2% of the general kernel): the
descriptor loads are what gained.
"""

import importlib.util
import json
import os
import sys

import torch

from msa_kernels import api
from msa_kernels.plan import page_table_from_req_to_token, plan_prefill
from provenance import commit  # noqa: E402

spec = importlib.util.spec_from_file_location("bench", os.path.join(os.path.dirname(__file__), "msa_kernel_bench.py"))
bench = importlib.util.module_from_spec(spec)
sys.modules["bench"] = bench
spec.loader.exec_module(bench)

SHAPES = [(8 * 1024, 0), (32 * 1024, 0), (4 * 1024, 124 * 1024), (128 * 1024, 0)]  # (new tokens, prefix)


def variants(plan, q, pool, selected, sm_scale):
    """name -> run(out) over one prefill plan's one-token tiles."""
    tiles, table = plan.attn_tiles, plan.page_table
    runs = {"general": lambda out: api._attention(tiles, table, q, pool.k, pool.v, selected, out, 1, sm_scale, bench.BLOCK)}
    for stages, warps in ((2, 4), (3, 4), (2, 8)):
        runs[f"one_token_tiles_s{stages}_w{warps}"] = lambda out, s=stages, w=warps: api._attention_one_token_tiles(
            tiles, table, q, pool.k, pool.v, selected, out, sm_scale, bench.BLOCK, num_warps=w, num_stages=s)
    return runs


def main() -> None:
    if os.environ.get("HKV"):
        bench.HKV = int(os.environ["HKV"])
        bench.HQ = 16 * bench.HKV
    pool = bench.Pool(tokens=260 * 1024)
    sm_scale = bench.D**-0.5
    rows = []
    for n, prefix in SHAPES:
        total = n + prefix
        table = page_table_from_req_to_token(pool.req_to_token([total], total), torch.arange(1, device="cuda"), total, bench.BLOCK)
        q = torch.randn(n, bench.HQ, bench.D, device="cuda", dtype=torch.bfloat16)
        iq = torch.randn(n, bench.HKV, bench.DI, device="cuda", dtype=torch.bfloat16)
        plan = plan_prefill(bench.PARAMS, table, [total], [n], num_index_heads=bench.HKV, block_major=False)
        selected = api.prefill_select(plan, iq, pool.ik)
        runs = variants(plan, q, pool, selected, sm_scale)
        reference = torch.empty_like(q)
        runs["general"](reference)
        row = {"N": n, "prefix": prefix, "hkv": bench.HKV, "ms": {}, "max_abs_diff": {}}
        for name, run in runs.items():
            out = torch.zeros_like(q)
            run(out)
            torch.cuda.synchronize()
            row["max_abs_diff"][name] = (out.float() - reference.float()).abs().max().item()
            row["ms"][name] = bench.bench_ms(lambda: run(out), min_reps=5, budget_ms=300)
        print(json.dumps({"N": n, "prefix": prefix, **{k: round(v, 3) for k, v in row["ms"].items()},
                          "max_abs_diff": max(row["max_abs_diff"].values())}), flush=True)
        rows.append(row)
        del q, iq, selected, reference
        torch.cuda.empty_cache()
    with open(os.path.join(os.environ.get("OUT", "."), f"prefill_attention_variants_hkv{bench.HKV}.json"), "w") as handle:
        json.dump({"gpu": torch.cuda.get_device_name(), "commit": commit(), "rows": rows}, handle, indent=1)


if __name__ == "__main__":
    main()
