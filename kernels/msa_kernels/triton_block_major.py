"""Triton kernel of KV-block-major sparse attention for prefill.

Query-major attention (``triton_attention``) loads each chosen K/V block once per query token:
at prefill every block is re-read by the ~2K tokens that chose it, and the kernel is bound by
L2-to-SM bandwidth at ~16 FLOP per byte (benchmarks/KERNEL_NOTES.md). Here the query->block map
is inverted: the (token, kv head, slot) *pairs* of a chunk are grouped by (kv head, page) (a
counting sort, ``triton_pair_plan``) and cut into tiles of at most ``PAIRS`` pairs of one block.
A program loads a block's K and V once for the whole run of tiles that share it, and per tile
gathers the ``PAIRS x group`` query rows and writes one partial output per pair (its softmax
normalised over that block, plus the base-2 log-sum-exp); ``merge_splits`` then combines a
token's partials, one per chosen block. fp8 K/V caches are read as in ``triton_attention``
(widened after the load, the K scale folded into ``qk_scale_log2``, the V scale applied to each
partial output).
"""

import triton
import triton.language as tl

from msa_kernels.triton_attention import merge_splits
from msa_kernels.triton_pair_plan import BLOCK_INDEX, COUNT, NEWEST, PAIR_OFFSET, TILE_OFFSET


@triton.jit
def block_major_attention_kernel(
    q_ptr, k_ptr, v_ptr, tok_pos_ptr, pair_ptr, tile_key_ptr, buckets_ptr, num_tiles_ptr,
    part_o_ptr, part_lse_ptr,
    tok_base, num_pages,
    s_q_t, s_q_h,
    s_k_slot, s_k_h,
    s_v_slot, s_v_h,
    s_bucket,
    s_po_p, s_po_g,
    s_pl_p,
    qk_scale_log2, v_scale,
    HKV: tl.constexpr, TOPK: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
    PAIRS: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
):
    """Persistent programs over a contiguous range of *tiles* each, the K/V of a key loaded once per *run*.

    Pairs come grouped by ``key = head * num_pages + page`` (``triton_pair_plan``): key ``k``'s
    pairs are ``pair[PAIR_OFFSET[k] ..`` ``+ COUNT[k]]``, cut into tiles of ``PAIRS`` from tile
    ``TILE_OFFSET[k]``; ``tile_key[t]`` names tile ``t``'s key, and ``pair[i] = (token - tok_base)
    * HKV * TOPK + head * TOPK + slot``. A run is the tiles of one key. The run's K and V are
    loaded before its tiles and held while only each tile's Q is gathered and its partials
    written: the K/V traffic falls from one block per tile to one per run (a 128K prefill reads
    each (block, head) in runs of tens to hundreds of tiles). A page is one block of the sequence,
    at the same index in every request sharing it (``BLOCK_INDEX[k]``), and ``NEWEST[k]`` is the
    newest key offset any pair of the run may see: no row past it (unwritten, possibly garbage)
    is loaded.
    """
    ROWS: tl.constexpr = PAIRS * GP
    rows = tl.arange(0, ROWS)
    in_tile = rows // GP
    g = rows % GP
    d = tl.arange(0, D)
    keys = tl.arange(0, BLOCK)
    num_tiles = tl.load(num_tiles_ptr)
    programs = tl.num_programs(0)
    tile = (tl.program_id(0) * num_tiles) // programs
    t_end = ((tl.program_id(0) + 1) * num_tiles) // programs
    while tile < t_end:
        key = tl.load(tile_key_ptr + tile)
        first_tile = tl.load(buckets_ptr + TILE_OFFSET * s_bucket + key)
        count = tl.load(buckets_ptr + COUNT * s_bucket + key)
        first_pair = tl.load(buckets_ptr + PAIR_OFFSET * s_bucket + key)
        run_stop = tl.minimum(first_tile + (count + PAIRS - 1) // PAIRS, t_end)
        blk = tl.load(buckets_ptr + BLOCK_INDEX * s_bucket + key)
        newest = tl.load(buckets_ptr + NEWEST * s_bucket + key)
        head = key // num_pages
        slots = (key % num_pages).to(tl.int64) * BLOCK + keys
        key_ok = keys <= newest
        k_t = tl.load(k_ptr + slots[None, :] * s_k_slot + head * s_k_h + d[:, None], mask=key_ok[None, :], other=0.0)
        v = tl.load(v_ptr + slots[:, None] * s_v_slot + head * s_v_h + d[None, :], mask=key_ok[:, None], other=0.0)
        # The next tile's pairs and queries are loaded before this tile is computed, so that the gather's
        # latency (pair ids, then the rows they name) overlaps the MMAs: 1.86 -> 1.52 ms at 8K on an H200; two
        # tiles ahead was slower than none (registers; benchmarks/results/block_major_prefetch_h200/).
        pair, live = _tile_pairs(pair_ptr, first_pair, first_tile, count, tile, run_stop, in_tile, PAIRS)
        q, limit = _tile_queries(q_ptr, tok_pos_ptr, pair, live, tok_base, head, blk, g, d, s_q_t, s_q_h, HKV, TOPK, G, BLOCK)
        pair_next, live_next = _tile_pairs(pair_ptr, first_pair, first_tile, count, tile + 1, run_stop, in_tile, PAIRS)
        for t in range(tile, run_stop):
            q_next, limit_next = _tile_queries(
                q_ptr, tok_pos_ptr, pair_next, live_next, tok_base, head, blk, g, d, s_q_t, s_q_h, HKV, TOPK, G, BLOCK)
            pair_after, live_after = _tile_pairs(pair_ptr, first_pair, first_tile, count, t + 2, run_stop, in_tile, PAIRS)
            _attend_tile(q, limit, pair, live & (g < G), k_t, v, keys, g, d, part_o_ptr, part_lse_ptr, s_po_p, s_po_g, s_pl_p,
                         qk_scale_log2, v_scale)
            pair, live, q, limit = pair_next, live_next, q_next, limit_next
            pair_next, live_next = pair_after, live_after
        tile = run_stop


@triton.jit
def _tile_pairs(pair_ptr, first_pair, first_tile, count, t, run_stop, in_tile, PAIRS: tl.constexpr):
    """Pair ids of tile ``t`` of a run (int64) and which rows hold one (none past ``run_stop``)."""
    done = (t - first_tile) * PAIRS
    live = (in_tile < count - done) & (t < run_stop)
    # int64: a pass of more than 16K tokens at four KV heads has pairs * (GP * D) past 2**31
    return tl.load(pair_ptr + first_pair + done + in_tile, mask=live, other=0).to(tl.int64), live


@triton.jit
def _tile_queries(q_ptr, tok_pos_ptr, pair, live, tok_base, head, blk, g, d, s_q_t, s_q_h,
                  HKV: tl.constexpr, TOPK: tl.constexpr, G: tl.constexpr, BLOCK: tl.constexpr):
    """A tile's gathered query rows and, per row, the newest key offset of the block it may see (-1: none)."""
    tok = tok_base + pair // (HKV * TOPK)
    limit = tl.where(live, tl.load(tok_pos_ptr + tok, mask=live, other=0) - blk * BLOCK, -1)
    row_ok = live & (g < G)
    q = tl.load(q_ptr + tok[:, None] * s_q_t + (head * G + g)[:, None] * s_q_h + d[None, :], mask=row_ok[:, None], other=0.0)
    return q, limit


@triton.jit
def _attend_tile(q, limit, pair, row_ok, k_t, v, keys, g, d, part_o_ptr, part_lse_ptr, s_po_p, s_po_g, s_pl_p,
                 qk_scale_log2, v_scale):
    """One tile's attention over the held block: each pair's partial output and base-2 log-sum-exp."""
    s = tl.dot(q, k_t.to(q.dtype)) * qk_scale_log2
    s = tl.where(keys[None, :] <= limit[:, None], s, float("-inf"))
    m = tl.max(s, axis=1)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    p = tl.exp2(s - m_safe[:, None])
    l_sum = tl.sum(p, axis=1)
    l_safe = tl.where(l_sum > 0, l_sum, 1.0)
    o = tl.dot(p.to(q.dtype), v.to(q.dtype)) / l_safe[:, None] * v_scale
    tl.store(part_o_ptr + pair[:, None] * s_po_p + g[:, None] * s_po_g + d[None, :], o.to(part_o_ptr.dtype.element_ty), mask=row_ok[:, None])
    tl.store(part_lse_ptr + pair * s_pl_p + g, m_safe + tl.log2(l_safe), mask=row_ok)


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
    pair0 = (t * HKV + h).to(tl.int64) * TOPK  # int64 as in the attention kernel
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    merge_splits(
        part_o_ptr + pair0 * s_po_p + g[:, None] * s_po_g + d[None, :], part_lse_ptr + pair0 * s_pl_p + g, s_po_p, s_pl_p,
        out_ptr + tok * s_o_t + (h * G + g)[:, None] * s_o_h + d[None, :],
        g < G, GP, D, count,
    )
