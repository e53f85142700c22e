"""Temporary: decode top-k, serial picks vs bitonic tl.topk over packed keys, alone, graph replays."""
import json, os, sys
import torch, triton
sys.path.insert(0, "benchmarks"); sys.path.insert(0, "kernels")
from msa_kernels import api
from msa_kernels.plan import plan_decode
from msa_kernels.reference import MSAParams
from msa_kernels.triton_select import decode_topk_kernel
P = MSAParams(block_size=128, topk=16, local_blocks=1, init_blocks=0)
REPS = 20
def graph_us(fn):
    fn(); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(REPS): fn()
    return 1000.0 * triton.testing.do_bench(g.replay, warmup=50, rep=300, return_mode="median") / REPS
rows = []
for batch, heads, live, graph_ctx in [(8,4,131072,131072),(8,4,131072,131456),(8,4,65536,65536),(1,4,32768,32768),(8,4,32768,32768),(32,4,32768,32768),(1,4,2048,131456),(16,4,2048,131456),(64,4,2048,131456),(16,4,32768,131456),(16,2,32768,131456)]:
    blocks = -(-graph_ctx // 128)
    pages = torch.arange(batch * blocks, device="cuda", dtype=torch.int32).view(batch, blocks)
    plan = plan_decode(P, pages, torch.full((batch,), live, device="cuda"), q_len=1, num_kv_heads=heads)
    t = plan.tiles
    rws = max(16, triton.next_power_of_2(heads))
    scores = torch.randn(batch, rws, plan.max_blocks, device="cuda")
    nbp = triton.next_power_of_2(plan.max_blocks)
    sels = {}
    def launch(form):
        bitonic, warps = form
        sel = sels.setdefault(form, torch.empty(batch, heads, 16, dtype=torch.int32, device="cuda"))
        def go():
            decode_topk_kernel[(batch, heads, 1)](scores, sel, t.tok0, t.pos0, t.ntok, scores.stride(0), scores.stride(1), sel.stride(0), sel.stride(1),
                NUM_HEADS=heads, BLOCK=128, NBP=nbp, TOPK=16, KP=16, LOCAL=1, INIT=0, **api.topk_widths(nbp), num_warps=warps, BITONIC_WIDTH=1 << 20 if bitonic else 0)
        return go
    forms = [(False, api.topk_num_warps(nbp))] + [(True, w) for w in (1, 2, 4, 8)]
    res = {}
    for form in forms + forms:
        res.setdefault(form, []).append(graph_us(launch(form)))
    row = {"batch": batch, "heads": heads, "live": live, "nbp": nbp, **{("bitonic" if b else "serial") + f"_w{w}_us": min(v) for (b, w), v in res.items()},
           "identical": all(torch.equal(sels[forms[0]], sels[f]) for f in forms)}
    rows.append(row); print(json.dumps(row), flush=True)
out = os.environ.get("OUT", ".")
json.dump({"gpu": torch.cuda.get_device_name(), "commit": os.environ.get("MSA_COMMIT"), "reps_per_graph": REPS, "rows": rows}, open(os.path.join(out, "topk_forms.json"), "w"), indent=1)
