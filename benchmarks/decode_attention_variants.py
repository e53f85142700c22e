"""Where the decode attention's time goes: forms of its one-token split path, timed alone.

Inside a decode step the sparse attention takes ~11 us at B1 L32K while it reads 4 MB of K/V, and
~20 us at B8 while it reads 32 MB (``decode_graph_kernels.py``): it is bound by its chain of
dependent memory round trips, not by bytes. This script times the shipped kernel
(``api.decode_attention``) against forms of its one-token, split, merge-in-the-last-split path
(no draft tree, no dense layer, 16-bit cache) that each remove one link of that chain:

* ``merge_unrolled``: the last split reads every split's log-sum-exp in one load and the partial
  outputs in an unrolled loop, where the shipped merge walks the splits twice in run-time loops
  (one round trip per split and pass, unless the compiler unrolls them);
* ``tma``: K and V of every chosen block but the newest by tensor descriptor, unmasked (as the
  extend kernel ``prefill_attention_kernel`` loads them), the newest by pointer and masked;
* ``pages``: the loop reads each chosen block's page id from a list written beforehand (as the
  top-k could write it) instead of the block id and then the page table: one load fewer per block;
* ``pages_merge_unrolled``: both of the two above;
* ``v_first``: a block's V load issued before its K load and score MMA;
* ``replica``: none of these (the script's kernel as the shipped one runs), so its time against
  the shipped kernel's says how far the simplified copy is from it;
* ``no_merge``: partials only, no ticket and no merge: what the merge costs at all (its output is
  not the attention's, so it is timed, not checked).

Each form is checked against the shipped kernel's output on the same inputs, then timed two ways:
a graph replay of the launch (``msa_kernel_bench.graph_replay_us``) and the kernel's own duration
after an L2 flush (``decode_graph_kernels.kernel_durations``).

``--launches`` instead times three forms over splits per (token, KV head) and pipeline stages.

Measured on an H200 (``results/decode_attention_variants_h200/``): only ``no_merge`` moved the
kernel by more than 0.5 us (B1 L32K 6.8 against 11.6 us), and the plan's launch was within 1 us of
the best everywhere.

    PYTHONPATH=kernels python benchmarks/decode_attention_variants.py --out rows.json [--launches]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, os.path.dirname(__file__))
import msa_kernel_bench as bench  # noqa: E402
from decode_graph_kernels import decode_inputs, kernel_durations  # noqa: E402
from msa_kernels.api import _LOG2E, decode_attention  # noqa: E402
from msa_kernels.triton_attention import _softmax_step, merge_splits  # noqa: E402
from msa_kernels.triton_select import load_tile  # noqa: E402
from provenance import commit  # noqa: E402

SHAPES = ((1, 32768), (8, 32768), (8, 131072), (32, 32768))  # (batch, context)
POOL_TOKENS = 1 << 21
FORMS = ("replica", "tma", "merge_unrolled", "pages", "pages_merge_unrolled", "v_first", "no_merge")


def launch_grid(plan_splits: int) -> list[tuple[str, int, int, int]]:
    """(form, splits, stages, warps) that ``--launches`` times: the plan's splits and its neighbours."""
    splits = sorted({2, max(1, plan_splits // 2), plan_splits, min(16, plan_splits * 2)})
    return [(form, n, stages, 4) for form in ("replica", "tma", "pages") for n in splits for stages in (2, 3, 4)]


@triton.jit
def _merge_unrolled(part_o_ptrs, part_lse_ptrs, s_po_s, s_pl_s, out_ptrs, row_ok, ROWS: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr, SP: tl.constexpr):
    """``merge_splits`` with the splits' LSEs in one load and the partials in an unrolled loop."""
    sp = tl.arange(0, SP)
    rows = tl.arange(0, ROWS)
    lse = tl.load(part_lse_ptrs[None, :] + sp[:, None] * s_pl_s, mask=(sp < SPLITS)[:, None] & (rows >= 0)[None, :], other=float("-inf"), cache_modifier=".cg")
    m = tl.max(lse, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m_safe[None, :])
    total = tl.sum(w, axis=0)
    acc = tl.zeros([ROWS, D], tl.float32)
    for s in tl.static_range(SPLITS):
        w_s = tl.sum(tl.where(sp[:, None] == s, w, 0.0), axis=0)
        acc += w_s[:, None] * tl.load(part_o_ptrs + s * s_po_s, cache_modifier=".cg")
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(out_ptrs, out.to(out_ptrs.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def split_attention_variant_kernel(
    q_ptr, k_ptr, v_ptr, k_desc, v_desc, page_ptr, sel_ptr, chosen_page_ptr,
    out_ptr, part_o_ptr, part_lse_ptr, ticket_ptr,
    tile_req_ptr, tile_tok0_ptr, tile_pos0_ptr, tile_ntok_ptr,
    s_q_t, s_q_h, s_k_slot, s_k_h, s_v_slot, s_v_h, s_pg_b, s_sel_t, s_sel_h, s_o_t, s_o_h,
    s_po_t, s_po_h, s_po_s, s_po_r, s_pl_t, s_pl_h, s_pl_s,
    qk_scale_log2,
    G: tl.constexpr, GP: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
    TOPK: tl.constexpr, KP: tl.constexpr, SPLITS: tl.constexpr, SP: tl.constexpr,
    MERGE: tl.constexpr, PAGES: tl.constexpr, V_FIRST: tl.constexpr, TMA: tl.constexpr,
):
    """One query token of a decode batch (q_len 1) and one KV head per program row of the grid;
    split ``program_id(2)`` of ``SPLITS`` reads chosen blocks ``split, split + SPLITS, ...``.
    ``MERGE``: 0 the shipped merge, 1 :func:`_merge_unrolled`, 2 none. ``PAGES``: read the chosen
    blocks' page ids from ``chosen_page`` (same layout as ``sel``) instead of via the page table.
    ``V_FIRST``: a block's V load is issued before its K load and score MMA, not after them.
    ``TMA``: every chosen block but the newest (the only one that can hold keys past the token)
    comes in by tensor descriptor, unmasked, as in ``prefill_attention_kernel``; the newest by
    pointer and masked, in the split that owns it."""
    tile = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    req = tl.load(tile_req_ptr + tile)
    tok0, pos0, ntok = load_tile(tile_tok0_ptr, tile_pos0_ptr, tile_ntok_ptr, tile)
    rows = tl.arange(0, ROWS)
    g = rows % GP
    row_ok = (rows < GP) & (g < G) & (ntok > 0)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + tok0 * s_q_t + (h * G + g)[:, None] * s_q_h + d[None, :], mask=row_ok[:, None], other=0.0)
    slot = tl.arange(0, KP)
    chosen = tl.load(sel_ptr + tok0 * s_sel_t + h * s_sel_h + slot, mask=slot < TOPK, other=-1)
    count = tl.sum((chosen >= 0).to(tl.int32), 0)
    keys = tl.arange(0, BLOCK)
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, D], tl.float32)
    if TMA:
        for i in range(split, count - 1, SPLITS):
            blk = tl.load(sel_ptr + tok0 * s_sel_t + h * s_sel_h + i)
            page = tl.load(page_ptr + req * s_pg_b + blk)
            k = k_desc.load([page * BLOCK, h * D])
            s = tl.dot(q, tl.trans(k)) * qk_scale_log2
            v = v_desc.load([page * BLOCK, h * D])
            m_i, l_i, acc = _softmax_step(m_i, l_i, acc, s, v, q.dtype)
        first = count - 1 if (count - 1) % SPLITS == split else count
    else:
        first = split
    for i in range(first, count, SPLITS):
        blk = tl.load(sel_ptr + tok0 * s_sel_t + h * s_sel_h + i)
        if PAGES:
            page = tl.load(chosen_page_ptr + tok0 * s_sel_t + h * s_sel_h + i).to(tl.int64)
        else:
            page = tl.load(page_ptr + req * s_pg_b + blk).to(tl.int64)
        kpos = blk * BLOCK + keys
        key_ok = kpos <= pos0
        slots = page * BLOCK + keys
        if V_FIRST:
            v = tl.load(v_ptr + slots[:, None] * s_v_slot + h * s_v_h + d[None, :], mask=key_ok[:, None], other=0.0)
        k_t = tl.load(k_ptr + slots[None, :] * s_k_slot + h * s_k_h + d[:, None], mask=key_ok[None, :], other=0.0)
        s = tl.dot(q, k_t) * qk_scale_log2
        s = tl.where(key_ok[None, :], s, float("-inf"))
        if not V_FIRST:
            v = tl.load(v_ptr + slots[:, None] * s_v_slot + h * s_v_h + d[None, :], mask=key_ok[:, None], other=0.0)
        m_i, l_i, acc = _softmax_step(m_i, l_i, acc, s, v, q.dtype)
    has_any = l_i > 0
    o = acc / tl.where(has_any, l_i, 1.0)[:, None]
    lse = tl.where(has_any, m_i + tl.log2(tl.where(has_any, l_i, 1.0)), float("-inf"))
    base = tile * s_po_t + h * s_po_h
    tl.store(part_o_ptr + base + split * s_po_s + rows[:, None] * s_po_r + d[None, :], o)
    lse_base = part_lse_ptr + tile * s_pl_t + h * s_pl_h + rows
    tl.store(lse_base + split * s_pl_s, lse)
    if MERGE != 2:
        tl.debug_barrier()
        ticket = ticket_ptr + tile * tl.num_programs(1) + h
        if tl.atomic_add(ticket, 1, sem="acq_rel", scope="gpu") == SPLITS - 1:
            o_ptrs = part_o_ptr + base + rows[:, None] * s_po_r + d[None, :]
            out_ptrs = out_ptr + tok0 * s_o_t + (h * G + g)[:, None] * s_o_h + d[None, :]
            if MERGE == 0:
                merge_splits(o_ptrs, lse_base, s_po_s, s_pl_s, out_ptrs, row_ok, ROWS, D, SPLITS)
            else:
                _merge_unrolled(o_ptrs, lse_base, s_po_s, s_pl_s, out_ptrs, row_ok, ROWS, D, SPLITS, SP)
            tl.atomic_xchg(ticket, 0, sem="relaxed", scope="gpu")


class VariantLaunch:
    """One form's launch over a plan's decode batch (q_len 1), with its scratch allocated once."""

    def __init__(self, plan, q, k, v, selected, form: str, splits: int | None = None, stages: int = 2, warps: int = 4):
        tiles = plan.tiles
        self.plan, self.q, self.k, self.v, self.selected = plan, q, k, v, selected
        self.merge = {"merge_unrolled": 1, "pages_merge_unrolled": 1, "no_merge": 2}.get(form, 0)
        self.use_pages = form.startswith("pages")
        self.v_first = form == "v_first"
        self.tma = form == "tma"
        hkv = k.shape[1]
        self.group = q.shape[1] // hkv
        self.rows = max(16, triton.next_power_of_2(self.group))
        self.splits = splits or plan.attn_splits
        self.stages, self.warps = stages, warps
        device = q.device
        self.part_o = torch.empty(tiles.count, hkv, self.splits, self.rows, q.shape[-1], dtype=torch.float32, device=device)
        self.part_lse = torch.empty(tiles.count, hkv, self.splits, self.rows, dtype=torch.float32, device=device)
        self.tickets = torch.zeros(tiles.count * hkv, dtype=torch.int32, device=device)
        self.out = torch.zeros_like(q)
        d = q.shape[-1]
        self.descriptors = [TensorDescriptor.from_tensor(c.view(c.shape[0], hkv * d), [bench.BLOCK, d]) for c in (k, v)]
        req = tiles.req.long()
        chosen = selected.long().clamp(min=0)
        table = plan.page_table.long()
        pages = table[req[:, None, None].expand_as(chosen), chosen]
        self.chosen_pages = torch.where(selected >= 0, pages, -1).to(torch.int32).contiguous()

    def __call__(self):
        plan, q, k, v, sel = self.plan, self.q, self.k, self.v, self.selected
        t = plan.tiles
        topk = sel.shape[-1]
        split_attention_variant_kernel[(t.count, k.shape[1], self.splits)](
            q, k, v, *self.descriptors, plan.page_table, sel, self.chosen_pages,
            self.out, self.part_o, self.part_lse, self.tickets,
            t.req, t.tok0, t.pos0, t.ntok,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), plan.page_table.stride(0),
            sel.stride(0), sel.stride(1), self.out.stride(0), self.out.stride(1),
            *self.part_o.stride()[:4], *self.part_lse.stride()[:3],
            q.shape[-1] ** -0.5 * _LOG2E,
            G=self.group, GP=triton.next_power_of_2(self.group), ROWS=self.rows, D=q.shape[-1], BLOCK=bench.BLOCK,
            TOPK=topk, KP=triton.next_power_of_2(topk), SPLITS=self.splits, SP=triton.next_power_of_2(self.splits),
            MERGE=self.merge, PAGES=self.use_pages, V_FIRST=self.v_first, TMA=self.tma, num_warps=self.warps, num_stages=self.stages,
        )
        return self.out


def measure(pool: bench.Pool, batch: int, context: int) -> dict:
    plan, q, _, selected = decode_inputs(pool, batch, context, 1)[0]
    shipped_out = decode_attention(plan, q, pool.k, pool.v, selected)
    row = {"batch": batch, "context": context, "attn_splits": plan.attn_splits}
    steps = {"shipped": lambda: decode_attention(plan, q, pool.k, pool.v, selected)}
    for form in FORMS:
        launch = VariantLaunch(plan, q, pool.k, pool.v, selected, form)
        out = launch()
        torch.cuda.synchronize()
        if form != "no_merge":
            row[f"{form}_max_abs_diff"] = (out.float() - shipped_out.float()).abs().max().item()
        steps[form] = launch
    for name, step in steps.items():
        row[f"{name}_replay_us"] = [bench.graph_replay_us(lambda i: step(), 1) for _ in range(3)]
        row[f"{name}_kernel_us"] = kernel_durations(step)
    print(json.dumps(row), flush=True)
    return row


def measure_launches(pool: bench.Pool, batch: int, context: int) -> list[dict]:
    """Kernel time of the replica, TMA and pages forms over splits per (token, kv head) and pipeline stages."""
    plan, q, _, selected = decode_inputs(pool, batch, context, 1)[0]
    shipped_out = decode_attention(plan, q, pool.k, pool.v, selected)
    rows = []
    for form, splits, stages, warps in launch_grid(plan.attn_splits):
        launch = VariantLaunch(plan, q, pool.k, pool.v, selected, form, splits, stages, warps)
        diff = (launch().float() - shipped_out.float()).abs().max().item()
        row = {"batch": batch, "context": context, "form": form, "splits": splits, "plan_splits": plan.attn_splits, "stages": stages,
               "warps": warps, "max_abs_diff": diff, "kernel_us": kernel_durations(launch)["split_attention_variant_kernel"]}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON file for the rows")
    parser.add_argument("--commit", default=commit(), help="commit of the script's checkout")
    parser.add_argument("--launches", action="store_true", help="time three forms over splits and stages instead of every form at the plan's launch")
    args = parser.parse_args()
    torch.manual_seed(0)
    pool = bench.Pool(POOL_TOKENS)
    if args.launches:
        rows = [row for batch, context in SHAPES for row in measure_launches(pool, batch, context)]
    else:
        rows = [measure(pool, batch, context) for batch, context in SHAPES]
    result = {"gpu": torch.cuda.get_device_name(), "triton": triton.__version__, "commit": args.commit, "rows": rows}
    with open(args.out, "w", encoding="utf-8") as handle:
        json.dump(result, handle, indent=1)


if __name__ == "__main__":
    main()
