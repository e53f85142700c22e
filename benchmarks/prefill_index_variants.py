"""The prefill indexer (GPU): forms of its block scan, indexer alone, random inputs, one request.

``prefill_index_topk_kernel`` (``triton_index``) walks a tile's visible blocks one at a time: the
block's page, its 128 index keys by masked pointer load, one 128 x 128 x 128 MMA, a causal mask
over the scores, the block max per row, and one offer to each row's running top-k. At 4K new
tokens after a 124K prefix that walk runs at about half the matmul rate (KERNEL_NOTES), so the
question is which of those steps costs the rest. Forms timed here (the kernel below is the
shipped scan with switches):

- ``shipped``: ``api.prefill_select`` as extend batches run it (split and merge included);
- ``WHOLE``: 0 masks every block (shipped); 1 scans the blocks that lie wholly at or before the
  tile's first token without the causal mask (every row sees every key there), by pointer load;
  2 the same by tensor descriptor (TMA). The tile's last one or two blocks stay masked;
- ``KEEP``: 1 offers each block to the running top-k (shipped); 2 gathers the block maxima of
  ``KP`` blocks and merges them into the running top-k with one bitonic top-k of ``2 KP`` keys;
  0 keeps no top-k at all (a row max only: wrong output, timed as the bound of the top-k's cost);
- warps and pipeline stages.

Every variant but ``KEEP=0`` must choose the shipped blocks (checked before timing). Outcome on an
H200 (``results/prefill_index_variants_h200/``): the masks were the cost, the top-k offers hide
behind the MMAs, and the chunked merge is slower. ``WHOLE=2`` with ``KEEP=1`` now ships
(4K after 124K 1.56 -> 1.09 ms, 128K 20.0 -> 14.9 ms), so ``shipped`` times that form from then on
and ``whole0_keep1_w8_s3`` the old one.
Usage: PYTHONPATH=kernels python benchmarks/prefill_index_variants.py (writes $OUT/
prefill_index_variants.json).
"""

import json
import os
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, os.path.dirname(__file__))
import msa_kernel_bench as bench  # noqa: E402
from msa_kernels import api  # noqa: E402
from msa_kernels.plan import page_table_from_req_to_token, plan_prefill  # noqa: E402
from msa_kernels.triton_index import _store_selection, _tile_rows, prefill_index_merge_kernel, split_share  # noqa: E402
from msa_kernels.triton_select import empty_top, forced_or_visible_scores, keep_top, order_bits  # noqa: E402
from provenance import commit  # noqa: E402

SHAPES = [(4 * 1024, 124 * 1024), (8 * 1024, 0), (32 * 1024, 0), (128 * 1024, 0)]  # (new tokens, prefix)


@triton.jit
def _key(ranked, blk):
    """int64 rank keys: the score's order bits above the reversed block id (ties to the lower block)."""
    return (order_bits(ranked).to(tl.int64) << 32) | (0x7FFFFFFF - (blk + tl.zeros(ranked.shape, tl.int32))).to(tl.int64)


@triton.jit
def _merge(top, chunk, ROWS: tl.constexpr, KP: tl.constexpr):
    """The ``KP`` largest keys of two ``[ROWS, KP]`` key sets, per row."""
    both = tl.reshape(tl.join(top, chunk), [ROWS, 2 * KP])
    return tl.topk(both, KP, dim=1)


@triton.jit
def _block_scores(q, ik_ptr, ik_desc, page, blk, row_pos, last_pos, keys, d, s_ik_slot, BLOCK: tl.constexpr, MASKED: tl.constexpr, DESC: tl.constexpr):
    """Block max of the tile's rows over one block's keys."""
    if MASKED:
        kpos = blk * BLOCK + keys
        k_t = tl.load(ik_ptr + (page * BLOCK + keys)[None, :] * s_ik_slot + d[:, None], mask=(kpos <= last_pos)[None, :], other=0.0)
        s = tl.where(kpos[None, :] <= row_pos[:, None], tl.dot(q, k_t), float("-inf"))
    elif DESC:
        s = tl.dot(q, tl.trans(ik_desc.load([(page * BLOCK).to(tl.int32), 0])))
    else:
        s = tl.dot(q, tl.load(ik_ptr + (page * BLOCK + keys)[None, :] * s_ik_slot + d[:, None]))
    return tl.max(s, axis=1)


@triton.jit
def _offer(top_val, top_id, top_key, chunk, best, ranked, blk, start, empty_key, slot, ROWS: tl.constexpr, KP: tl.constexpr, KEEP: tl.constexpr):
    """One block's ranked scores into the running top-k of the ``KEEP`` form."""
    if KEEP == 0:
        best = tl.maximum(best, ranked)
    elif KEEP == 1:
        top_val, top_id = keep_top(top_val, top_id, ranked, blk, KP)
    else:
        at = (blk - start) % KP
        chunk = tl.where(slot[None, :] == at, _key(ranked, blk)[:, None], chunk)
        if at == KP - 1:
            top_key = _merge(top_key, chunk, ROWS, KP)
            chunk = empty_key
    return top_val, top_id, top_key, chunk, best


@triton.jit(do_not_specialize=["s_pg_b"])
def index_scan_variant_kernel(
    iq_ptr, ik_ptr, ik_desc, page_ptr, sel_ptr, cand_val_ptr, cand_id_ptr,
    tile_req_ptr, tile_tok0_ptr, tile_pos0_ptr, tile_ntok_ptr,
    s_iq_t, s_iq_h, s_ik_slot, s_pg_b, s_sel_t, s_sel_h, s_cand_tile, s_cand_split,
    NUM_HEADS: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
    TOPK: tl.constexpr, KP: tl.constexpr, LOCAL: tl.constexpr, INIT: tl.constexpr, SPLIT: tl.constexpr,
    WHOLE: tl.constexpr, KEEP: tl.constexpr,
):
    tile = tl.program_id(0)
    req = tl.load(tile_req_ptr + tile)
    tok0, pos0, t, h, row_ok, row_pos, last_pos = _tile_rows(tile_tok0_ptr, tile_pos0_ptr, tile_ntok_ptr, tile, NUM_HEADS, ROWS)
    start, end = split_share(last_pos // BLOCK + 1, SPLIT)
    if WHOLE > 0:
        mid = tl.minimum(tl.maximum((pos0 + 1) // BLOCK, start), end)
    else:
        mid = start
    d = tl.arange(0, D)
    keys = tl.arange(0, BLOCK)
    slot = tl.arange(0, KP)
    q = tl.load(iq_ptr + (tok0 + t)[:, None] * s_iq_t + h[:, None] * s_iq_h + d[None, :], mask=row_ok[:, None], other=0.0)
    own = row_pos // BLOCK
    page_row = page_ptr + req * s_pg_b
    top_val, top_id = empty_top(ROWS, TOPK, KP)
    empty_key = _key(tl.full([ROWS, KP], float("-inf"), tl.float32), tl.zeros([ROWS, KP], tl.int32))
    top_key = empty_key
    chunk = empty_key
    best = tl.full([ROWS], float("-inf"), tl.float32)
    for blk in range(start, mid):  # every key visible to every row: no mask
        page = tl.load(page_row + blk).to(tl.int64)
        score = _block_scores(q, ik_ptr, ik_desc, page, blk, row_pos, last_pos, keys, d, s_ik_slot, BLOCK, False, WHOLE == 2)
        top_val, top_id, top_key, chunk, best = _offer(
            top_val, top_id, top_key, chunk, best, forced_or_visible_scores(score, blk, own, LOCAL, INIT), blk, start, empty_key, slot, ROWS, KP, KEEP)
    for blk in range(mid, end):
        page = tl.load(page_row + blk).to(tl.int64)
        score = _block_scores(q, ik_ptr, ik_desc, page, blk, row_pos, last_pos, keys, d, s_ik_slot, BLOCK, True, False)
        top_val, top_id, top_key, chunk, best = _offer(
            top_val, top_id, top_key, chunk, best, forced_or_visible_scores(score, blk, own, LOCAL, INIT), blk, start, empty_key, slot, ROWS, KP, KEEP)
    if KEEP == 0:
        top_val = tl.where(slot[None, :] == 0, best[:, None], top_val)
    elif KEEP == 2:
        top_key = _merge(top_key, chunk, ROWS, KP)
        value_bits = (top_key >> 32).to(tl.int32)
        taken = (value_bits > order_bits(tl.full([ROWS, KP], float("-inf"), tl.float32))) & (slot[None, :] < TOPK)
        top_id = tl.where(taken, 0x7FFFFFFF - (top_key & 0x7FFFFFFF).to(tl.int32), -1)
        value = tl.where(value_bits < 0, value_bits ^ 0x7FFFFFFF, value_bits).to(tl.float32, bitcast=True)
        top_val = tl.where(taken, value, float("-inf"))
    if SPLIT:
        at = tile * s_cand_tile + tl.program_id(1) * s_cand_split + tl.arange(0, ROWS)[:, None] * KP + slot[None, :]
        tl.store(cand_val_ptr + at, top_val)
        tl.store(cand_id_ptr + at, top_id)
    else:
        _store_selection(sel_ptr, top_id, tok0, t, h, row_ok, s_sel_t, s_sel_h, TOPK, KP)


def run_variant(plan, iq, ik, whole: int, keep: int, warps: int, stages: int) -> torch.Tensor:
    """One variant's selection ``[tokens, heads, topk]`` over the plan's index tiles (as ``api.prefill_select``)."""
    p = plan.params
    hkv, di = iq.shape[1], iq.shape[-1]
    ik2 = ik.reshape(ik.shape[0], di)
    itiles = plan.index_tiles
    rows = itiles.max_tokens * hkv
    kp = api._pow2(p.topk)
    split = plan.index_splits > 1
    selected = torch.empty(plan.num_tokens, hkv, p.topk, dtype=torch.int32, device=iq.device)
    cand_shape = (itiles.count, plan.index_splits, rows, kp) if split else (1, 1, 1, 1)
    cand_val = torch.empty(cand_shape, dtype=torch.float32, device=iq.device)
    cand_id = torch.empty(cand_shape, dtype=torch.int32, device=iq.device)
    ik_desc = TensorDescriptor.from_tensor(ik2, [p.block_size, di])
    index_scan_variant_kernel[(itiles.count, plan.index_splits)](
        iq, ik2, ik_desc, plan.page_table, selected, cand_val, cand_id,
        itiles.req, itiles.tok0, itiles.pos0, itiles.ntok,
        iq.stride(0), iq.stride(1), ik2.stride(0), plan.page_table.stride(0),
        selected.stride(0), selected.stride(1), cand_val.stride(0), cand_val.stride(1),
        NUM_HEADS=hkv, ROWS=rows, D=di, BLOCK=p.block_size, TOPK=p.topk, KP=kp,
        LOCAL=p.local_blocks, INIT=p.init_blocks, SPLIT=split, WHOLE=whole, KEEP=keep,
        num_warps=warps, num_stages=stages,
    )
    if split:
        prefill_index_merge_kernel[(itiles.count,)](
            cand_val, cand_id, selected, itiles.tok0, itiles.pos0, itiles.ntok, plan.index_splits,
            cand_val.stride(0), cand_val.stride(1), selected.stride(0), selected.stride(1),
            NUM_HEADS=hkv, ROWS=rows, TOPK=p.topk, KP=kp, num_warps=4,
        )
    return selected


def variants(plan, iq, ik):
    """name -> run() returning the selection."""
    runs = {"shipped": lambda: api.prefill_select(plan, iq, ik)}
    forms = [(whole, 1, launch) for whole in (0, 1, 2) for launch in ((8, 3), (4, 3), (8, 2), (8, 4))]
    forms += [(whole, 2, launch) for whole in (0, 2) for launch in ((8, 3), (4, 3))]
    forms += [(whole, 0, (8, 3)) for whole in (0, 2)]
    for whole, keep, (warps, stages) in forms:
        runs[f"whole{whole}_keep{keep}_w{warps}_s{stages}"] = (
            lambda w=whole, k=keep, nw=warps, ns=stages: run_variant(plan, iq, ik, w, k, nw, ns))
    return runs


def main() -> None:
    pool = bench.Pool(tokens=260 * 1024)
    only = os.environ.get("VARIANTS")
    rows = []
    for n, prefix in SHAPES:
        total = n + prefix
        table = page_table_from_req_to_token(pool.req_to_token([total], total), torch.arange(1, device="cuda"), total, bench.BLOCK)
        iq = torch.randn(n, bench.HKV, bench.DI, device="cuda", dtype=torch.bfloat16)
        plan = plan_prefill(bench.PARAMS, table, [total], [n], num_index_heads=bench.HKV, block_major=False)
        runs = variants(plan, iq, pool.ik)
        if only:
            runs = {k: v for k, v in runs.items() if k == "shipped" or any(part in k for part in only.split(","))}
        reference = runs["shipped"]().clone()
        row = {"N": n, "prefix": prefix, "hkv": bench.HKV, "index_splits": plan.index_splits, "ms": {}, "same_blocks": {}}
        for name, run in runs.items():
            chosen = run()
            torch.cuda.synchronize()
            row["same_blocks"][name] = bool(torch.equal(chosen, reference))
            row["ms"][name] = bench.bench_ms(run, min_reps=5, budget_ms=200)
        print(json.dumps({"N": n, "prefix": prefix, "splits": plan.index_splits,
                          **{k: round(v, 3) for k, v in row["ms"].items()},
                          "differ": [k for k, same in row["same_blocks"].items() if not same]}), flush=True)
        rows.append(row)
        del iq, reference
        torch.cuda.empty_cache()
    with open(os.path.join(os.environ.get("OUT", "."), "prefill_index_variants.json"), "w") as handle:
        json.dump({"gpu": torch.cuda.get_device_name(), "commit": commit(), "rows": rows}, handle, indent=1)


if __name__ == "__main__":
    main()
