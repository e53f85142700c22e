"""Triton kernels of the MSA index branch: causal block-max scores of the index keys.

Decode has few query rows (index heads x q_len) and a long key range, so the 128 keys of a block
sit on the MMA's M side and the query rows on N; the key range is split over programs.
Prefill has many query rows: a tile of (token, index head) rows sits on M and loops over every
visible block, keeping a running top-k per row in registers, so the
[heads x tokens x blocks] score matrix never exists in memory.
"""

import triton
import triton.language as tl

from msa_kernels.triton_select import forced_or_visible_scores, sort_ids


@triton.jit
def decode_index_scores_kernel(
    iq_ptr, ik_ptr, page_ptr, score_ptr,
    tile_tok0_ptr, tile_pos0_ptr, tile_ntok_ptr,
    s_iq_t, s_iq_h,
    s_ik_slot,
    s_pg_b,
    s_sc_b, s_sc_r,
    NUM_HEADS: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
    SPLITS: tl.constexpr,
):
    """score[b, row, blk] = max_{j in blk, j <= pos(row)} iq[row] . ik[j]; row = token * heads + head."""
    b = tl.program_id(0)
    split = tl.program_id(1)
    tok0 = tl.load(tile_tok0_ptr + b)
    pos0 = tl.load(tile_pos0_ptr + b)
    ntok = tl.load(tile_ntok_ptr + b)
    rows = tl.arange(0, ROWS)
    t = rows // NUM_HEADS
    row_ok = t < ntok
    row_pos = pos0 + t
    d = tl.arange(0, D)
    q_t = tl.load(
        iq_ptr + (tok0 + t)[None, :] * s_iq_t + (rows % NUM_HEADS)[None, :] * s_iq_h + d[:, None],
        mask=row_ok[None, :],
        other=0.0,
    )  # [D, ROWS]: query rows on the MMA's N side
    last_pos = pos0 + ntok - 1
    nblk = last_pos // BLOCK + 1
    per_split = tl.cdiv(nblk, SPLITS)
    start = split * per_split
    end = tl.minimum(start + per_split, nblk)
    keys = tl.arange(0, BLOCK)
    for blk in range(start, end):
        page = tl.load(page_ptr + b * s_pg_b + blk).to(tl.int64)
        kpos = blk * BLOCK + keys
        k = tl.load(ik_ptr + (page * BLOCK + keys)[:, None] * s_ik_slot + d[None, :], mask=(kpos <= last_pos)[:, None], other=0.0)
        s = tl.dot(k, q_t)  # [BLOCK, ROWS]: keys on M
        s = tl.where(kpos[:, None] <= row_pos[None, :], s, float("-inf"))
        tl.store(score_ptr + b * s_sc_b + rows * s_sc_r + blk, tl.max(s, axis=0), mask=row_ok)


@triton.jit
def prefill_index_topk_kernel(
    iq_ptr, ik_ptr, page_ptr, sel_ptr,
    tile_req_ptr, tile_tok0_ptr, tile_pos0_ptr, tile_ntok_ptr,
    s_iq_t, s_iq_h,
    s_ik_slot,
    s_pg_b,
    s_sel_t, s_sel_h,
    NUM_HEADS: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
    TOPK: tl.constexpr, KP: tl.constexpr, LOCAL: tl.constexpr, INIT: tl.constexpr,
):
    """Chosen blocks of a tile of (token, index head) rows: block-max scores fused with top-k."""
    tile = tl.program_id(0)
    req = tl.load(tile_req_ptr + tile)
    tok0 = tl.load(tile_tok0_ptr + tile)
    pos0 = tl.load(tile_pos0_ptr + tile)
    ntok = tl.load(tile_ntok_ptr + tile)
    rows = tl.arange(0, ROWS)
    t = rows // NUM_HEADS
    h = rows % NUM_HEADS
    row_ok = t < ntok
    row_pos = pos0 + t
    own = row_pos // BLOCK
    d = tl.arange(0, D)
    q = tl.load(iq_ptr + (tok0 + t)[:, None] * s_iq_t + h[:, None] * s_iq_h + d[None, :], mask=row_ok[:, None], other=0.0)
    slot = tl.arange(0, KP)
    # Slots past TOPK (KP is a power of two) hold +inf so they are never the minimum to replace.
    top_val = tl.where(slot[None, :] < TOPK, float("-inf"), float("inf")) + tl.zeros([ROWS, KP], tl.float32)
    top_id = tl.full([ROWS, KP], -1, tl.int32)
    last_pos = pos0 + ntok - 1
    nblk = last_pos // BLOCK + 1
    keys = tl.arange(0, BLOCK)
    for blk in range(0, nblk):
        page = tl.load(page_ptr + req * s_pg_b + blk).to(tl.int64)
        kpos = blk * BLOCK + keys
        k_t = tl.load(ik_ptr + (page * BLOCK + keys)[None, :] * s_ik_slot + d[:, None], mask=(kpos <= last_pos)[None, :], other=0.0)
        s = tl.dot(q, k_t)  # [ROWS, BLOCK]
        s = tl.where(kpos[None, :] <= row_pos[:, None], s, float("-inf"))
        ranked = forced_or_visible_scores(tl.max(s, axis=1), blk, own, LOCAL, INIT)
        weakest = tl.min(top_val, axis=1)
        weakest_slot = tl.argmin(top_val, axis=1)
        replace = (ranked > weakest)[:, None] & (slot[None, :] == weakest_slot[:, None])
        top_val = tl.where(replace, ranked[:, None], top_val)
        top_id = tl.where(replace, blk, top_id)
    chosen = sort_ids(top_id)
    tl.store(
        sel_ptr + (tok0 + t)[:, None] * s_sel_t + h[:, None] * s_sel_h + slot[None, :],
        chosen,
        mask=row_ok[:, None] & (slot[None, :] < TOPK),
    )
