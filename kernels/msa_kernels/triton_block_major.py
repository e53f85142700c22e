"""Triton kernel of KV-block-major sparse attention for prefill.

Query-major attention (``triton_attention``) loads each chosen K/V block once per query token:
at prefill every block is re-read by the ~2K tokens that chose it, and the kernel is bound by
L2-to-SM bandwidth at ~16 FLOP per byte (benchmarks/KERNEL_NOTES.md). Here the query->block map
is inverted: the (token, kv head, slot) *pairs* of a chunk are sorted by (kv head, page), so a
program takes ``PAIRS`` consecutive pairs, which nearly always share one block, loads that block's
K and V once for all ``PAIRS x group`` query rows and writes one partial output per pair (its
softmax normalised over that block, plus the base-2 log-sum-exp). ``merge_splits`` then combines
a token's partials, one per chosen block.

A program whose pairs span several blocks walks them in ascending key order; every row belongs
to exactly one block, so a row's partial is complete after that block's iteration.
"""

import triton
import triton.language as tl

from msa_kernels.triton_attention import merge_splits


@triton.jit
def block_major_attention_kernel(
    q_ptr, k_ptr, v_ptr, sel_ptr, tok_pos_ptr, key_ptr, pair_ptr, part_o_ptr, part_lse_ptr,
    num_pairs, tok_base, num_pages, sentinel,
    s_q_t, s_q_h,
    s_k_slot, s_k_h,
    s_v_slot, s_v_h,
    s_sel_t, s_sel_h,
    s_po_p, s_po_g,
    s_pl_p,
    qk_scale_log2,
    HKV: tl.constexpr, TOPK: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
    PAIRS: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
):
    """Partial attention of ``PAIRS`` sorted (token, kv head, slot) pairs against their blocks.

    ``key[i] = head * num_pages + page`` ascending (``sentinel`` for the -1 padding of a selection,
    sorted last); ``pair[i] = (token - tok_base) * HKV * TOPK + head * TOPK + slot``.
    """
    ROWS: tl.constexpr = PAIRS * GP
    rows = tl.arange(0, ROWS)
    idx = tl.program_id(0) * PAIRS + rows // GP
    g = rows % GP
    key = tl.load(key_ptr + idx, mask=idx < num_pairs, other=sentinel)
    if tl.min(key, 0) < sentinel:  # else every pair of this program is padding
        live = key < sentinel
        row_ok = live & (g < G)
        pair = tl.load(pair_ptr + idx, mask=live, other=0)
        tok = tok_base + pair // (HKV * TOPK)
        head = (pair // TOPK) % HKV
        slot = pair % TOPK
        blk = tl.load(sel_ptr + tok * s_sel_t + head * s_sel_h + slot, mask=live, other=0)
        # The newest key each row may see inside its block (the causal bound of its own block).
        limit = tl.load(tok_pos_ptr + tok, mask=live, other=0) - blk * BLOCK
        d = tl.arange(0, D)
        q = tl.load(q_ptr + tok[:, None] * s_q_t + (head * G + g)[:, None] * s_q_h + d[None, :], mask=row_ok[:, None], other=0.0)
        keys = tl.arange(0, BLOCK)
        o = tl.zeros([ROWS, D], tl.float32)
        lse = tl.zeros([ROWS], tl.float32)
        # Keys are sorted: a new block starts wherever a pair's key differs from the previous pair's.
        prev = tl.load(key_ptr + idx - 1, mask=(rows >= GP) & live, other=-1)
        distinct = tl.sum((live & (g == 0) & (key != prev)).to(tl.int32), 0)
        done = -1
        for _ in range(distinct):
            cur = tl.min(tl.where(live & (key > done), key, sentinel), 0)
            mine = live & (key == cur)
            h = cur // num_pages
            slots = (cur % num_pages).to(tl.int64) * BLOCK + keys
            # Rows past a block's newest visible token may hold another request's garbage: never load them.
            key_ok = keys <= tl.max(tl.where(mine, limit, -1), 0)
            k_t = tl.load(k_ptr + slots[None, :] * s_k_slot + h * s_k_h + d[:, None], mask=key_ok[None, :], other=0.0)
            s = tl.dot(q, k_t) * qk_scale_log2
            s = tl.where(mine[:, None] & (keys[None, :] <= limit[:, None]), s, float("-inf"))
            m = tl.max(s, axis=1)
            m_safe = tl.where(m == float("-inf"), 0.0, m)
            p = tl.exp2(s - m_safe[:, None])
            l_sum = tl.sum(p, axis=1)
            v = tl.load(v_ptr + slots[:, None] * s_v_slot + h * s_v_h + d[None, :], mask=key_ok[:, None], other=0.0)
            o_blk = tl.dot(p.to(v.dtype), v) / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
            o = tl.where(mine[:, None], o_blk, o)
            lse = tl.where(mine, m_safe + tl.log2(tl.where(l_sum > 0, l_sum, 1.0)), lse)
            done = cur
        tl.store(part_o_ptr + pair[:, None] * s_po_p + g[:, None] * s_po_g + d[None, :], o.to(part_o_ptr.dtype.element_ty), mask=row_ok[:, None])
        tl.store(part_lse_ptr + pair * s_pl_p + g, lse, mask=row_ok)


@triton.jit
def merge_block_partials_kernel(
    part_o_ptr, part_lse_ptr, sel_ptr, out_ptr,
    tok_base,
    s_po_p, s_po_g,
    s_pl_p,
    s_sel_t, s_sel_h,
    s_o_t, s_o_h,
    HKV: tl.constexpr, TOPK: tl.constexpr, KP: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
):
    """One program per (token, kv head): the log-sum-exp merge of its per-block partials.

    A selection is sorted with its -1 padding last, so the valid partials are the first ``count``.
    """
    t = tl.program_id(0)
    h = tl.program_id(1)
    tok = tok_base + t
    slot = tl.arange(0, KP)
    sel = tl.load(sel_ptr + tok * s_sel_t + h * s_sel_h + slot, mask=slot < TOPK, other=-1)
    count = tl.sum((sel >= 0).to(tl.int32), 0)
    pair0 = (t * HKV + h) * TOPK
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    merge_splits(
        part_o_ptr + pair0 * s_po_p + g[:, None] * s_po_g + d[None, :], part_lse_ptr + pair0 * s_pl_p + g, s_po_p, s_pl_p,
        out_ptr + tok * s_o_t + (h * G + g)[:, None] * s_o_h + d[None, :],
        g < G, GP, D, count,
    )
