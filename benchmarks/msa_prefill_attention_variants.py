"""Exploration (GPU): the query-major prefill attention against variants of its loads and launch.

The query-major prefill attention reads 16 blocks of K and V (64 KB each) per (token, KV head)
for 16 query rows, and on random inputs it is bound by the traffic from L2 (KERNEL_NOTES.md,
"Where the time goes"). Variants timed here, attention alone (selection computed once), random
inputs, one request:

- ``shipped``: ``api._attention`` as the prefill plan launches it (4 warps, 2 stages);
- ``stages{S}_warps{W}``: the shipped kernel under other launch settings;
- ``split``: every chosen block but the token's newest read without masks (only the newest can
  hold keys past the token), the newest one masked as before, pointer loads;
- ``tma_s{S}``: the same split, the unmasked blocks' K and V loaded by TMA (a tensor descriptor
  over the cache as ``[slots, kv_heads * dim]``), ``S`` pipeline stages.

Every variant's output is compared with the shipped kernel's before timing.
Usage: PYTHONPATH=kernels python benchmarks/msa_prefill_attention_variants.py (writes $OUT/
prefill_attention_variants.json).
"""

import importlib.util
import json
import os
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from msa_kernels import api
from msa_kernels.plan import page_table_from_req_to_token, plan_prefill
from msa_kernels.triton_attention import _softmax_step, sparse_attention_kernel

spec = importlib.util.spec_from_file_location("bench", os.path.join(os.path.dirname(__file__), "msa_kernel_bench.py"))
bench = importlib.util.module_from_spec(spec)
sys.modules["bench"] = bench
spec.loader.exec_module(bench)


@triton.jit
def split_prefill_attention_kernel(
    q_ptr, k_ptr, v_ptr, k_desc, v_desc, page_ptr, sel_ptr, out_ptr,
    tile_req_ptr, tile_tok0_ptr, tile_pos0_ptr,
    s_q_t, s_q_h, s_k_slot, s_k_h, s_v_slot, s_v_h, s_pg_b, s_sel_t, s_sel_h, s_o_t, s_o_h,
    qk_scale_log2, v_scale,
    G: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, TOPK: tl.constexpr, KP: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    """One token (one-token tile) and one KV head: its chosen blocks but the newest unmasked, the
    newest (sorted last) with the key-range and causal masks."""
    tile = tl.program_id(0)
    h = tl.program_id(1)
    req = tl.load(tile_req_ptr + tile)
    tok = tl.load(tile_tok0_ptr + tile)
    pos = tl.load(tile_pos0_ptr + tile)
    g = tl.arange(0, G)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + tok * s_q_t + (h * G + g)[:, None] * s_q_h + d[None, :])
    slot = tl.arange(0, KP)
    list_ptr = sel_ptr + tok * s_sel_t + h * s_sel_h
    chosen = tl.load(list_ptr + slot, mask=slot < TOPK, other=-1)
    count = tl.sum((chosen >= 0).to(tl.int32), 0)
    keys = tl.arange(0, BLOCK)
    m_i = tl.full([G], float("-inf"), tl.float32)
    l_i = tl.zeros([G], tl.float32)
    acc = tl.zeros([G, D], tl.float32)
    for i in range(0, count - 1):
        blk = tl.load(list_ptr + i)
        page = tl.load(page_ptr + req * s_pg_b + blk)
        if USE_TMA:
            k = k_desc.load([page * BLOCK, h * D])
            s = tl.dot(q, tl.trans(k).to(q.dtype)) * qk_scale_log2
            v = v_desc.load([page * BLOCK, h * D])
        else:
            slots = page.to(tl.int64) * BLOCK + keys
            k_t = tl.load(k_ptr + slots[None, :] * s_k_slot + h * s_k_h + d[:, None])
            s = tl.dot(q, k_t.to(q.dtype)) * qk_scale_log2
            v = tl.load(v_ptr + slots[:, None] * s_v_slot + h * s_v_h + d[None, :])
        m_i, l_i, acc = _softmax_step(m_i, l_i, acc, s, v, q.dtype)
    blk = tl.load(list_ptr + count - 1)
    page = tl.load(page_ptr + req * s_pg_b + blk).to(tl.int64)
    kpos = blk * BLOCK + keys
    key_ok = kpos <= pos
    slots = page * BLOCK + keys
    k_t = tl.load(k_ptr + slots[None, :] * s_k_slot + h * s_k_h + d[:, None], mask=key_ok[None, :], other=0.0)
    s = tl.where(key_ok[None, :], tl.dot(q, k_t.to(q.dtype)) * qk_scale_log2, float("-inf"))
    v = tl.load(v_ptr + slots[:, None] * s_v_slot + h * s_v_h + d[None, :], mask=key_ok[:, None], other=0.0)
    m_i, l_i, acc = _softmax_step(m_i, l_i, acc, s, v, q.dtype)
    o = acc / l_i[:, None] * v_scale
    tl.store(out_ptr + tok * s_o_t + (h * G + g)[:, None] * s_o_h + d[None, :], o.to(out_ptr.dtype.element_ty))


def _alloc(size: int, alignment: int, stream):
    return torch.empty(size, device="cuda", dtype=torch.int8)


def split_attention(plan, q, k_cache, v_cache, selected, out, sm_scale, use_tma, stages, warps):
    tiles = plan.attn_tiles
    hkv, d = k_cache.shape[1], q.shape[-1]
    group = q.shape[1] // hkv
    block = plan.params.block_size
    k_desc = TensorDescriptor.from_tensor(k_cache.view(k_cache.shape[0], hkv * d), [block, d])
    v_desc = TensorDescriptor.from_tensor(v_cache.view(v_cache.shape[0], hkv * d), [block, d])
    table = plan.page_table
    split_prefill_attention_kernel[(tiles.count, hkv)](
        q, k_cache, v_cache, k_desc, v_desc, table, selected, out,
        tiles.req, tiles.tok0, tiles.pos0,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        table.stride(0), selected.stride(0), selected.stride(1), out.stride(0), out.stride(1),
        sm_scale * 1.4426950408889634, 1.0,
        G=group, D=d, BLOCK=block, TOPK=selected.shape[-1], KP=triton.next_power_of_2(selected.shape[-1]),
        USE_TMA=use_tma, num_warps=warps, num_stages=stages,
    )


def shipped_with(plan, q, k_cache, v_cache, selected, out, sm_scale, stages, warps):
    """``api._attention``'s one-token-tile prefill launch under other warps / stages."""
    tiles = plan.attn_tiles
    hkv, d = k_cache.shape[1], q.shape[-1]
    group = q.shape[1] // hkv
    topk = selected.shape[-1]
    stand_in = torch.empty(1, dtype=torch.int32, device=q.device)
    scratch = torch.empty(1, 1, 1, 1, dtype=torch.float32, device=q.device)
    sparse_attention_kernel[(tiles.count, hkv, 1)](
        q, k_cache, v_cache, plan.page_table, selected, stand_in,
        out, scratch, scratch, stand_in,
        tiles.req, tiles.tok0, tiles.pos0, tiles.ntok,
        tiles.tok0, tiles.tok0, tiles.tok0,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        plan.page_table.stride(0), selected.stride(0), selected.stride(1), out.stride(0), out.stride(1),
        *scratch.stride(), *scratch.stride()[:3],
        sm_scale * 1.4426950408889634, 1.0,
        G=group, GP=group, ROWS=max(16, group), D=d, BLOCK=plan.params.block_size,
        TOPK=topk, KP=triton.next_power_of_2(topk), UP=triton.next_power_of_2(topk), SPLITS=1, WRITE_PARTIAL=False,
        SINGLE_TOKEN=True, TREE=False, NW=16, WB=1, TOKEN_TILES=1, DENSE=False,
        num_warps=warps, num_stages=stages,
    )


def main() -> None:
    triton.set_allocator(_alloc)
    K = 1024
    shapes = [(8 * K, 0), (32 * K, 0), (4 * K, 124 * K), (128 * K, 0)]
    if os.environ.get("HKV"):
        bench.HKV = int(os.environ["HKV"])  # ranks' KV heads under TP (2 at TP2)
        bench.HQ = 16 * bench.HKV
    pool = bench.Pool(tokens=260 * K)
    sm_scale = bench.D**-0.5
    rows = []
    for n, prefix in shapes:
        total = n + prefix
        rtt = pool.req_to_token([total], total)
        table = page_table_from_req_to_token(rtt, torch.arange(1, device="cuda"), total, bench.BLOCK)
        q = torch.randn(n, bench.HQ, bench.D, device="cuda", dtype=torch.bfloat16)
        iq = torch.randn(n, bench.HKV, bench.DI, device="cuda", dtype=torch.bfloat16)
        plan = plan_prefill(bench.PARAMS, table, [total], [n], num_index_heads=bench.HKV, block_major=False)
        selected = api.prefill_select(plan, iq, pool.ik)
        reference = torch.empty_like(q)
        api._attention(plan.attn_tiles, plan.page_table, q, pool.k, pool.v, selected, reference, 1, sm_scale, bench.BLOCK)
        variants = {"shipped": lambda o: api._attention(plan.attn_tiles, plan.page_table, q, pool.k, pool.v, selected, o, 1, sm_scale, bench.BLOCK)}
        for stages in (1, 2, 3, 4):
            for warps in (2, 4, 8):
                variants[f"stages{stages}_warps{warps}"] = lambda o, s=stages, w=warps: shipped_with(plan, q, pool.k, pool.v, selected, o, sm_scale, s, w)
        for stages in (2, 3):
            variants[f"split_s{stages}"] = lambda o, s=stages: split_attention(plan, q, pool.k, pool.v, selected, o, sm_scale, False, s, 4)
        for stages in (2, 3, 4):
            for warps in (4, 8):
                variants[f"tma_s{stages}_w{warps}"] = lambda o, s=stages, w=warps: split_attention(plan, q, pool.k, pool.v, selected, o, sm_scale, True, s, w)
        row = {"N": n, "prefix": prefix, "hkv": bench.HKV, "ms": {}, "max_abs_diff": {}, "errors": {}}
        for name, run in variants.items():
            out = torch.zeros_like(q)
            try:
                run(out)
                torch.cuda.synchronize()
            except Exception as error:  # a launch setting the kernel cannot take (shared memory)
                row["errors"][name] = str(error).splitlines()[0][:200]
                continue
            row["max_abs_diff"][name] = (out.float() - reference.float()).abs().max().item()
            row["ms"][name] = bench.bench_ms(lambda: run(out), min_reps=5, budget_ms=300)
        best = min(row["ms"], key=row["ms"].get)
        row["best"] = best
        print(json.dumps({"N": n, "prefix": prefix, "shipped": row["ms"]["shipped"], "best": best, "best_ms": row["ms"][best],
                          "diff_best": row["max_abs_diff"][best]}), flush=True)
        print("  " + ", ".join(f"{k} {v:.3f}" for k, v in sorted(row["ms"].items(), key=lambda kv: kv[1])), flush=True)
        if row["errors"]:
            print("  errors: " + json.dumps(row["errors"]), flush=True)
        rows.append(row)
        del q, iq, selected, reference
        torch.cuda.empty_cache()
    out_dir = os.environ.get("OUT", ".")
    with open(os.path.join(out_dir, f"prefill_attention_variants_hkv{bench.HKV}.json"), "w") as handle:
        json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, handle, indent=1)


if __name__ == "__main__":
    main()
