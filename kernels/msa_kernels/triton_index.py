"""Triton kernels of the MSA index branch: causal block-max scores of the index keys.

Decode has few query rows (index heads x q_len) and a long key range, so the 128 keys of a block
sit on the MMA's M side and the query rows on N; the key range is split over programs.
Prefill has many query rows: a tile of (token, index head) rows sits on M and scans its visible
blocks, keeping a running top-k per row in registers, so the [heads x tokens x blocks] score
matrix never exists in memory. ``prefill_index_topk_kernel`` has two forms:

* single pass (``SPLIT`` false): one program per tile scans every visible block and writes the
  sorted selection. Right when there are enough tiles to fill the GPU (a long prefill without
  prefix).
* split (``SPLIT`` true, then ``prefill_index_merge_kernel``): a short chunk after a long prefix
  has few tiles that each walk the whole prefix, so program (tile, s) scans only the s-th
  contiguous share of the tile's blocks and writes its per-row candidates (KP slots of ranked
  score and block id) to scratch; the merge keeps the top-k of the splits' candidates. Forced
  blocks rank +inf in whichever split holds them, so they survive the merge.

Index keys are bf16 (or the model's dtype) or, opt-in, float8_e4m3fn with one fp32 scale per
token (``KEY_FP8``; format in ``reference.quantize_index_keys``). Each key's score is multiplied
by its scale after the MMA (one multiply per score instead of one per key element; exact, the
scales being powers of two).

The decode scan with a bf16 query feeds the fp8 keys to the MMA as loaded: the query is split once
into two fp8 terms (``triton_index_quant.split_e4m3``, exact for bf16 values), and each half of
the 128 dimensions gets its own MMA per term, the four results added in fp32. Widening each
block's keys in registers instead held the scan to half the copy bandwidth (B8 L128K on an H200,
``benchmarks/decode_index_scan_variants.py``: 69 us widened, 56 us in halves). The halves are for
precision: Hopper's fp8 MMA keeps about 14 bits while it accumulates, and one MMA over all 128
dimensions put scores up to 5.5e-4 (of the row's largest) off the fp32 sum, enough to trade a
block outside the kernel tests' near-tie tolerance; in halves, 2.3e-4 (widened: 3e-7). Either is
far under the keys' own e4m3 rounding. Other queries (fp32, fp16: more bits than two terms hold)
and the prefill scans, bound by MMAs where the decode scan is bound by bytes, widen the keys.
"""

import triton
import triton.language as tl

from msa_kernels.triton_index_quant import e4m3_column_scales, split_e4m3
from msa_kernels.triton_select import TILE_POINTERS, empty_top, forced_or_visible_scores, keep_top, load_tile, sort_ids
from msa_kernels.triton_tree import main_pass_limits


@triton.jit
def decode_query_columns(iq_ptr, tok0, ntok, s_iq_t, s_iq_h, first, NUM_HEADS: tl.constexpr, ROWS: tl.constexpr, DIMS: tl.constexpr):
    """Dimensions ``first .. first + DIMS - 1`` of a decode tile's index query rows, as columns
    ``[DIMS, ROWS]`` (row = token * heads + head; rows past the tile's ``ntok`` tokens are zeros)."""
    rows = tl.arange(0, ROWS)
    t = rows // NUM_HEADS
    return tl.load(
        iq_ptr + (tok0 + t)[None, :] * s_iq_t + (rows % NUM_HEADS)[None, :] * s_iq_h + first + tl.arange(0, DIMS)[:, None],
        mask=(t < ntok)[None, :],
        other=0.0,
    )


@triton.jit
def block_share(nblk, part, parts):
    """``(start, end)``: the contiguous share of blocks ``0 .. nblk - 1`` that part ``part`` of ``parts`` takes."""
    per_part = tl.cdiv(nblk, parts)
    start = part * per_part
    return start, tl.minimum(start + per_part, nblk)


@triton.jit
def split_block_range(last_pos, split, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    """``(first, end)``: the contiguous share of blocks ``0 .. last_pos // BLOCK`` that program ``split`` of ``SPLITS`` scans."""
    return block_share(tl.cdiv(last_pos + 1, BLOCK), split, SPLITS)


@triton.jit
def decode_index_scores_kernel(
    iq_ptr, ik_ptr, iks_ptr, page_ptr, score_ptr,
    tile_tok0_ptr, tile_pos0_ptr, tile_ntok_ptr,
    s_iq_t, s_iq_h,
    s_ik_slot,
    s_pg_b,
    s_sc_b, s_sc_r,
    NUM_HEADS: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
    SPLITS: tl.constexpr, KEY_FP8: tl.constexpr, QUERY_TERMS: tl.constexpr = False,
    TREE: tl.constexpr = False, EARLY_DEPENDENTS: tl.constexpr = False,
):
    """score[b, row, blk] = max_{j in blk, j <= pos(row)} iq[row] . ik[j]; row = token * heads + head.

    ``KEY_FP8``: ``ik`` is fp8 and ``iks[slot]`` its scale (else ``iks_ptr`` is not read).
    ``QUERY_TERMS`` (with ``KEY_FP8``, bf16 ``iq`` only): the MMAs take the keys as fp8 against the
    query split into two fp8 terms, per half of the dimensions, rather than the keys widened.
    ``TREE`` (draft-tree verify): every row scans the request's prefix only, ``j < pos0``, the
    blocks ``0 .. cdiv(pos0, BLOCK) - 1``; :func:`tree_window_scores_kernel` adds each row's path.
    ``EARLY_DEPENDENTS``: let a kernel launched after this one by programmatic dependent launch
    (the decode top-k) start at once; it waits for this grid's scores itself (``gdc_wait``).
    """
    if EARLY_DEPENDENTS:
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    split = tl.program_id(1)
    tok0, pos0, ntok = load_tile(tile_tok0_ptr, tile_pos0_ptr, tile_ntok_ptr, b)
    rows = tl.arange(0, ROWS)
    t = rows // NUM_HEADS
    row_ok = t < ntok
    # query rows on the MMA's N side
    if QUERY_TERMS:
        q0 = decode_query_columns(iq_ptr, tok0, ntok, s_iq_t, s_iq_h, 0, NUM_HEADS, ROWS, D // 2).to(tl.float32)
        q1 = decode_query_columns(iq_ptr, tok0, ntok, s_iq_t, s_iq_h, D // 2, NUM_HEADS, ROWS, D // 2).to(tl.float32)
        q_scale, q_inverse = e4m3_column_scales(q0, q1)
        hi0, lo0 = split_e4m3(q0, q_inverse)
        hi1, lo1 = split_e4m3(q1, q_inverse)
        half = tl.arange(0, D // 2)
    else:
        q_t = decode_query_columns(iq_ptr, tok0, ntok, s_iq_t, s_iq_h, 0, NUM_HEADS, ROWS, D)
        d = tl.arange(0, D)
    last_pos, row_pos = main_pass_limits(pos0, ntok, t, TREE)
    start, end = split_block_range(last_pos, split, SPLITS, BLOCK)
    keys = tl.arange(0, BLOCK)
    for blk in range(start, end):
        page = tl.load(page_ptr + b * s_pg_b + blk).to(tl.int64)
        kpos = blk * BLOCK + keys
        if QUERY_TERMS:
            k_half = ik_ptr + (page * BLOCK + keys)[:, None] * s_ik_slot + half[None, :]
            k0 = tl.load(k_half, mask=(kpos <= last_pos)[:, None], other=0.0)
            k1 = tl.load(k_half + D // 2, mask=(kpos <= last_pos)[:, None], other=0.0)
            # [BLOCK, ROWS], keys on M; each MMA accumulates alone, the sums add in fp32
            s = tl.dot(k0, hi0) + tl.dot(k1, hi1) + (tl.dot(k0, lo0) + tl.dot(k1, lo1)) * 0.0625
            s *= tl.load(iks_ptr + page * BLOCK + keys, mask=kpos <= last_pos, other=0.0)[:, None] * q_scale[None, :]
        else:
            k = tl.load(ik_ptr + (page * BLOCK + keys)[:, None] * s_ik_slot + d[None, :], mask=(kpos <= last_pos)[:, None], other=0.0)
            if KEY_FP8:
                s = tl.dot(k.to(q_t.dtype), q_t)
                s *= tl.load(iks_ptr + page * BLOCK + keys, mask=kpos <= last_pos, other=0.0)[:, None]
            else:
                s = tl.dot(k, q_t)
        s = tl.where(kpos[:, None] <= row_pos[None, :], s, float("-inf"))
        tl.store(score_ptr + b * s_sc_b + rows * s_sc_r + blk, tl.max(s, axis=0), mask=row_ok)


@triton.jit
def tree_window_scores_kernel(
    iq_ptr, ik_ptr, iks_ptr, score_ptr,
    tile_tok0_ptr, tile_pos0_ptr, tile_ntok_ptr,
    depth_ptr, anc_ptr, slot_ptr,
    s_iq_t, s_iq_h,
    s_ik_slot,
    s_sc_b, s_sc_r,
    NUM_HEADS: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
    NW: tl.constexpr, WB: tl.constexpr, KEY_FP8: tl.constexpr,
):
    """Draft-tree verify: fold each token's own path into its block scores, after the prefix scan.

    Program (request, head, token). The request's verify tokens sit in cache slots ``slot[tok0 +
    i]``; the token sees those on its path (its ``ancestors`` bits), ancestor ``a`` at position
    ``pos0 + depth[a]``, so in block ``(pos0 + depth[a]) // BLOCK`` whatever slot holds it. The
    path spans the ``WB`` blocks from ``pos0 // BLOCK`` on: each gets the max of the prefix scan's
    score (its keys before ``pos0``) and the token's path keys in it; blocks past the window's
    last position are left alone (no token's position reaches them).
    """
    b = tl.program_id(0)
    h = tl.program_id(1)
    t = tl.program_id(2)
    tok0, pos0, ntok = load_tile(tile_tok0_ptr, tile_pos0_ptr, tile_ntok_ptr, b)
    token_ok = t < ntok
    i = tl.arange(0, NW)
    on_path = ((tl.load(anc_ptr + tok0 + t, mask=token_ok, other=0) >> i.to(tl.int64)) & 1) != 0
    on_path = on_path & (i < ntok) & token_ok
    slots = tl.load(slot_ptr + tok0 + i, mask=on_path, other=0)
    d = tl.arange(0, D)
    keys = tl.load(ik_ptr + slots[:, None] * s_ik_slot + d[None, :], mask=on_path[:, None], other=0.0)
    query = tl.load(iq_ptr + (tok0 + t) * s_iq_t + h * s_iq_h + d, mask=token_ok, other=0.0)
    s = tl.sum(keys.to(tl.float32) * query.to(tl.float32)[None, :], axis=1)  # [NW]
    if KEY_FP8:
        s *= tl.load(iks_ptr + slots, mask=on_path, other=0.0)
    s = tl.where(on_path, s, float("-inf"))
    blk_of = (pos0 + tl.load(depth_ptr + tok0 + i, mask=on_path, other=0)) // BLOCK
    first = pos0 // BLOCK
    last = (pos0 + ntok - 1) // BLOCK
    row = score_ptr + b * s_sc_b + (t * NUM_HEADS + h) * s_sc_r
    for w in tl.static_range(WB):
        blk = first + w
        prefix = tl.load(row + blk, mask=token_ok & (blk * BLOCK < pos0), other=float("-inf"))
        path = tl.max(tl.where(blk_of == blk, s, float("-inf")), axis=0)
        tl.store(row + blk, tl.maximum(prefix, path), mask=token_ok & (blk <= last))


@triton.jit
def _tile_rows(tile_tok0_ptr, tile_pos0_ptr, tile_ntok_ptr, tile, NUM_HEADS: tl.constexpr, ROWS: tl.constexpr):
    """Rows of an indexer tile: row = token * heads + head. Returns tok0, pos0, token, head, row_ok, row_pos, last_pos."""
    tok0, pos0, ntok = load_tile(tile_tok0_ptr, tile_pos0_ptr, tile_ntok_ptr, tile)
    rows = tl.arange(0, ROWS)
    t = rows // NUM_HEADS
    return tok0, pos0, t, rows % NUM_HEADS, t < ntok, pos0 + t, pos0 + ntok - 1


@triton.jit
def split_share(nblk, SPLIT: tl.constexpr):
    """``(start, end)``: the blocks of ``0 .. nblk - 1`` a prefill scan program takes: with ``SPLIT``
    the contiguous share of its grid column (``program_id(1)`` of ``num_programs(1)``), else all."""
    if SPLIT:
        return block_share(nblk, tl.program_id(1), tl.num_programs(1))
    return 0, nblk


@triton.jit
def _scan_blocks(
    iq_ptr, ik_ptr, ik_desc, iks_ptr, page_row_ptr, tok0, pos0, t, h, row_ok, row_pos, last_pos, start, end,
    s_iq_t, s_iq_h, s_ik_slot,
    ROWS: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
    TOPK: tl.constexpr, KP: tl.constexpr, LOCAL: tl.constexpr, INIT: tl.constexpr, KEY_FP8: tl.constexpr,
    DESC: tl.constexpr,
):
    """Running top-k ``(ranked [ROWS, KP], block ids)`` of the tile's rows over blocks ``start .. end-1``.

    Two loops. The blocks that end at or before the tile's first token hold only keys every row
    sees: no causal mask, no key mask, and (``DESC``) the keys by tensor descriptor, one bulk copy
    per block. Only the tile's own one or two blocks, the last, are masked. Masking every block
    held the scan to 1.56 ms at 4K new tokens after a 124K prefix on an H200, against 1.09 ms in
    this form (128K new tokens 20.0 against 14.9 ms; ``benchmarks/prefill_index_variants.py``).
    """
    d = tl.arange(0, D)
    q = tl.load(iq_ptr + (tok0 + t)[:, None] * s_iq_t + h[:, None] * s_iq_h + d[None, :], mask=row_ok[:, None], other=0.0)
    own = row_pos // BLOCK
    top_val, top_id = empty_top(ROWS, TOPK, KP)
    keys = tl.arange(0, BLOCK)
    whole_end = tl.minimum(tl.maximum((pos0 + 1) // BLOCK, start), end)
    for blk in range(start, whole_end):
        page = tl.load(page_row_ptr + blk)
        if DESC:
            s = tl.dot(q, tl.trans(ik_desc.load([page * BLOCK, 0])).to(q.dtype))
        else:
            s = tl.dot(q, tl.load(ik_ptr + (page.to(tl.int64) * BLOCK + keys)[None, :] * s_ik_slot + d[:, None]).to(q.dtype))
        if KEY_FP8:
            s *= tl.load(iks_ptr + page.to(tl.int64) * BLOCK + keys)[None, :]
        ranked = forced_or_visible_scores(tl.max(s, axis=1), blk, own, LOCAL, INIT)
        top_val, top_id = keep_top(top_val, top_id, ranked, blk, KP)
    for blk in range(whole_end, end):
        page = tl.load(page_row_ptr + blk).to(tl.int64)
        kpos = blk * BLOCK + keys
        k_t = tl.load(ik_ptr + (page * BLOCK + keys)[None, :] * s_ik_slot + d[:, None], mask=(kpos <= last_pos)[None, :], other=0.0)
        s = tl.dot(q, k_t.to(q.dtype))  # [ROWS, BLOCK]
        if KEY_FP8:
            s *= tl.load(iks_ptr + page * BLOCK + keys, mask=kpos <= last_pos, other=0.0)[None, :]
        s = tl.where(kpos[None, :] <= row_pos[:, None], s, float("-inf"))
        ranked = forced_or_visible_scores(tl.max(s, axis=1), blk, own, LOCAL, INIT)
        top_val, top_id = keep_top(top_val, top_id, ranked, blk, KP)
    return top_val, top_id


@triton.jit
def _store_selection(sel_ptr, top_id, tok0, t, h, row_ok, s_sel_t, s_sel_h, TOPK: tl.constexpr, KP: tl.constexpr):
    """Write each row's chosen blocks sorted ascending, -1 padded."""
    slot = tl.arange(0, KP)
    tl.store(
        sel_ptr + (tok0 + t)[:, None] * s_sel_t + h[:, None] * s_sel_h + slot[None, :],
        sort_ids(top_id),
        mask=row_ok[:, None] & (slot[None, :] < TOPK),
    )


@triton.jit(do_not_specialize=["s_pg_b"], do_not_specialize_on_alignment=TILE_POINTERS)
def prefill_index_topk_kernel(
    iq_ptr, ik_ptr, ik_desc, iks_ptr, page_ptr, sel_ptr, cand_val_ptr, cand_id_ptr,
    tile_req_ptr, tile_tok0_ptr, tile_pos0_ptr, tile_ntok_ptr,
    s_iq_t, s_iq_h,
    s_ik_slot,
    s_pg_b,
    s_sel_t, s_sel_h,
    s_cand_tile, s_cand_split,
    NUM_HEADS: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
    TOPK: tl.constexpr, KP: tl.constexpr, LOCAL: tl.constexpr, INIT: tl.constexpr,
    SPLIT: tl.constexpr, KEY_FP8: tl.constexpr, DESC: tl.constexpr,
):
    """Block-max scores fused with a running top-k over a tile of (token, index head) rows.

    Single pass (``SPLIT`` false, grid ``(tiles,)``): scans every visible block and writes the
    sorted selection. Split (grid ``(tiles, splits)``): program (tile, s) scans the s-th contiguous
    share of the blocks and writes every row's ``[KP]`` candidate list (padding rows too, so the
    merge reads no uninitialised memory) at ``tile * s_cand_tile + s * s_cand_split``; the split
    count is the grid's, not a constexpr, so batch shapes do not recompile. ``KEY_FP8`` as in
    :func:`decode_index_scores_kernel`. ``DESC``: ``ik_desc`` is a tensor descriptor of the keys
    viewed as ``[slots, D]`` in ``[BLOCK, D]`` boxes (else it is not read).
    """
    tile = tl.program_id(0)
    req = tl.load(tile_req_ptr + tile)
    tok0, pos0, t, h, row_ok, row_pos, last_pos = _tile_rows(tile_tok0_ptr, tile_pos0_ptr, tile_ntok_ptr, tile, NUM_HEADS, ROWS)
    start, end = split_share(last_pos // BLOCK + 1, SPLIT)
    top_val, top_id = _scan_blocks(
        iq_ptr, ik_ptr, ik_desc, iks_ptr, page_ptr + req * s_pg_b, tok0, pos0, t, h, row_ok, row_pos, last_pos, start, end,
        s_iq_t, s_iq_h, s_ik_slot, ROWS, D, BLOCK, TOPK, KP, LOCAL, INIT, KEY_FP8, DESC,
    )
    if SPLIT:
        at = tile * s_cand_tile + tl.program_id(1) * s_cand_split
        at += tl.arange(0, ROWS)[:, None] * KP + tl.arange(0, KP)[None, :]
        tl.store(cand_val_ptr + at, top_val)
        tl.store(cand_id_ptr + at, top_id)
    else:
        _store_selection(sel_ptr, top_id, tok0, t, h, row_ok, s_sel_t, s_sel_h, TOPK, KP)


@triton.jit(do_not_specialize=["splits"], do_not_specialize_on_alignment=TILE_POINTERS)
def prefill_index_merge_kernel(
    cand_val_ptr, cand_id_ptr, sel_ptr,
    tile_tok0_ptr, tile_pos0_ptr, tile_ntok_ptr,
    splits,
    s_cand_tile, s_cand_split,
    s_sel_t, s_sel_h,
    NUM_HEADS: tl.constexpr, ROWS: tl.constexpr, TOPK: tl.constexpr, KP: tl.constexpr,
):
    """Chosen blocks of a tile: the top-k of its splits' candidates, offered split by split.

    Only the first ``TOPK`` slots of each list are offered (the rest are the +inf fillers of
    ``empty_top``); empty slots are -inf and never taken. Splits cover disjoint blocks, so no
    block is offered twice. Both loops run at run time: unrolling the offers (``static_range``)
    made this small kernel take 5.8 s to compile on the H200, which a server's first long prompt
    paid (SGLang's log of the mid-size model); the offers are a few loads per row.
    """
    tile = tl.program_id(0)
    tok0, _, t, h, row_ok, _, _ = _tile_rows(tile_tok0_ptr, tile_pos0_ptr, tile_ntok_ptr, tile, NUM_HEADS, ROWS)
    top_val, top_id = empty_top(ROWS, TOPK, KP)
    rows = tl.arange(0, ROWS)
    for split in range(0, splits):
        at = tile * s_cand_tile + split * s_cand_split + rows * KP
        for j in range(0, TOPK):
            ranked = tl.load(cand_val_ptr + at + j)
            ids = tl.load(cand_id_ptr + at + j)
            top_val, top_id = keep_top(top_val, top_id, ranked, ids[:, None], KP)
    _store_selection(sel_ptr, top_id, tok0, t, h, row_ok, s_sel_t, s_sel_h, TOPK, KP)
