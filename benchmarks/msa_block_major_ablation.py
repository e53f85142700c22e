"""Ablation of the prefill attention forms (GPU): query-major vs KV-block-major, pass size, sort cost.

Times the attention alone (selection computed once), block-major with 8K- and 16K-token passes,
and the pairs' grouping by key in 8K passes, at the shapes that set ``BLOCK_MAJOR_FROM``. (Its committed
results predate the counting sort: their ``sort_ms`` / ``sort_and_tiles_ms`` timed the torch.sort grouping.)
Usage: PYTHONPATH=kernels python benchmarks/msa_block_major_ablation.py  (writes $OUT or ./
block_major_explore3.json). Results: benchmarks/results/msa_kernels_h100_block_major_ablation.json.
"""
import json, os, sys
import torch
import importlib.util
spec = importlib.util.spec_from_file_location("bench", "benchmarks/msa_kernel_bench.py")
bench = importlib.util.module_from_spec(spec); sys.modules["bench"] = bench; spec.loader.exec_module(bench)
from msa_kernels import api
from msa_kernels.plan import page_table_from_req_to_token, plan_prefill

K = 1024
pool = bench.Pool(tokens=260 * K)
res = []
for n, prefix in [(1 * K, 0), (2 * K, 0), (4 * K, 0), (8 * K, 0), (32 * K, 0), (128 * K, 0), (4 * K, 124 * K), (1 * K, 31 * K)]:
    total = n + prefix
    rtt = pool.req_to_token([total], total)
    table = page_table_from_req_to_token(rtt, torch.arange(1, device="cuda"), total, bench.BLOCK)
    q = torch.randn(n, bench.HQ, bench.D, device="cuda", dtype=torch.bfloat16)
    iq = torch.randn(n, bench.HKV, bench.DI, device="cuda", dtype=torch.bfloat16)
    row = {"N": n, "prefix": prefix}
    plan = plan_prefill(bench.PARAMS, table, [total], [n], num_index_heads=bench.HKV, block_major=False)
    sel = api.prefill_select(plan, iq, pool.ik)
    row["index_splits"] = plan.index_splits
    row["index_ms"] = bench.bench_ms(lambda: api.prefill_select(plan, iq, pool.ik))
    out = torch.empty_like(q)
    row["qm_attn_ms"] = bench.bench_ms(lambda: api._attention(plan.attn_tiles, plan.page_table, q, pool.k, pool.v, sel, out, 1, 0.088, 128), min_reps=3)
    for chunk in (8192, 16384):
        bplan = plan_prefill(bench.PARAMS, table, [total], [n], num_index_heads=bench.HKV, block_major=True, block_major_chunk=chunk)
        out2 = torch.empty_like(q)
        api._attention_block_major(bplan, q, pool.k, pool.v, sel, out2, 0.088, 128)
        row[f"bm_attn_ms_c{chunk}"] = bench.bench_ms(lambda: api._attention_block_major(bplan, q, pool.k, pool.v, sel, out2, 0.088, 128), min_reps=3)
    row["max_abs_diff_vs_qm"] = (out2.float() - out.float()).abs().max().item()
    c = min(n, 8192)
    npg = pool.k.shape[0] // 128
    row["group_pairs_ms"] = bench.bench_ms(lambda: [api._group_pairs(table, bplan.token_req, bplan.token_pos, sel, s0, min(c, n - s0), npg, 128, 4)
                                                     for s0 in range(0, n, c)], min_reps=3)
    print(json.dumps(row), flush=True)
    res.append(row)
    del q, iq, sel, out, out2
    torch.cuda.empty_cache()
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "block_major_explore3.json"), "w"), indent=1)
