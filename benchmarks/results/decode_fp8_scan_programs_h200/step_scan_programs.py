"""Temporary: whole decode step with fp8 index keys, scan at 32 vs 4 programs per SM (graph replay)."""
import json, sys, os, torch
sys.path.insert(0, "benchmarks"); sys.path.insert(0, "kernels")  # run from the repository root
import msa_kernel_bench as bench
from msa_kernels.api import run_decode
from msa_kernels.plan import page_table_from_req_to_token, plan_decode
torch.manual_seed(0)
pool = bench.Pool(8 * 131072)
shapes = [(8, 131072), (32, 32768), (8, 32768), (1, 32768), (64, 8192)]
rows = []
for rnd in range(3):
    for batch, L in shapes:
        sets = max(1, min(4, int(400e6 // bench.decode_model_bytes(L, batch, 1))))
        base = []
        for _ in range(sets):
            rtt = pool.req_to_token([L] * batch, L)
            table = page_table_from_req_to_token(rtt, torch.arange(batch, device="cuda"), L, bench.BLOCK)
            q = torch.randn(batch, bench.HQ, bench.D, device="cuda", dtype=torch.bfloat16)
            iq = torch.randn(batch, bench.HKV, bench.DI, device="cuda", dtype=torch.bfloat16)
            base.append((table, q, iq))
        for ipsm in ((32, 4) if rnd % 2 == 0 else (4, 32)):
            for dtype in ("fp8", "bf16"):
                plans = [plan_decode(bench.PARAMS, t, torch.full((batch,), L, device="cuda"), num_kv_heads=bench.HKV, index_programs_per_sm=ipsm) for t, _, _ in base]
                if dtype == "fp8":
                    step = lambda i: run_decode(plans[i], base[i][1], pool.k, pool.v, base[i][2], pool.ik8, ik_scale=pool.iks)
                else:
                    step = lambda i: run_decode(plans[i], base[i][1], pool.k, pool.v, base[i][2], pool.ik)
                us = bench.graph_replay_us(step, sets)
                row = {"round": rnd, "batch": batch, "L": L, "index_dtype": dtype, "index_programs_per_sm": ipsm, "us": round(us, 2)}
                rows.append(row); print(json.dumps(row), flush=True)
out = os.environ.get("OUT", ".")
with open(os.path.join(out, "step_fp8_scan_programs.jsonl"), "w") as f:
    for r in rows: f.write(json.dumps(r) + "\n")
