"""Triton kernels that turn block scores into chosen blocks: top-k, forced blocks, unions.

Conventions shared by every MSA kernel here: block ids are int32, a chosen-block list is sorted
ascending with ``-1`` padding at the end, and ``_BIG`` stands in for ``-1`` while sorting so that
padding sorts last.
"""

import triton
import triton.language as tl

_BIG = tl.constexpr(1 << 30)
#: Widest score row the decode top-k ranks by :func:`topk_ids_bitonic` (see there and ``api.topk_num_warps``).
BITONIC_MAX_WIDTH = tl.constexpr(1024)

#: The tile tensors' parameters of the kernels that take a plan's tiles. An extend batch's kernels
#: compile once per process (``prepare_prefill``), not once per batch shape: Triton specializes a
#: pointer on 16-byte alignment, and a tile tensor is a row of the plan's stacked ``[4, tiles]``
#: table (aligned only when the tile count is a multiple of 4), so the extend kernels do not
#: specialize these (nor the batch-sized integers beside them, the page table's row stride and
#: the index splits); the loads they feed are scalar. Specialized, a TP2 server's first 32K prompt
#: and then its first radix hit of one compiled two index kernels each, inside the requests (2.22 s
#: and 1.67 s to first token, against 0.22 s and 0.04 s the next time;
#: ``benchmarks/results/first_prompt_h200/``). The general attention kernel does not specialize
#: them either: extends take it where the one-token-tile kernel's descriptor loads do not fit
#: (``api._descriptor_loads_fit``: fp8 KV caches, GPUs before Hopper), and it compiled a variant
#: per page-table width and tile alignment there, after ``prepare_prefill``.
TILE_POINTERS = ["tile_req_ptr", "tile_tok0_ptr", "tile_pos0_ptr", "tile_ntok_ptr"]


@triton.jit
def load_tile(tile_tok0_ptr, tile_pos0_ptr, tile_ntok_ptr, tile):
    """``(tok0, pos0, ntok)`` of a tile: its first row of q, that row's position, its token count."""
    return tl.load(tile_tok0_ptr + tile), tl.load(tile_pos0_ptr + tile), tl.load(tile_ntok_ptr + tile)


@triton.jit
def sort_ids(ids):
    """Sort block ids ascending along the last axis, ``-1`` padding last."""
    x = tl.where(ids < 0, _BIG, ids)
    x = tl.sort(x)  # sorts along the last axis
    return tl.where(x == _BIG, -1, x)


@triton.jit
def forced_or_visible_scores(scores, blk, own, LOCAL: tl.constexpr, INIT: tl.constexpr):
    """Rank key of each block: +inf for forced blocks, -inf for invisible ones, else its score."""
    visible = blk <= own
    forced = visible & ((blk > own - LOCAL) | (blk < INIT))
    ranked = tl.where(visible, scores, float("-inf"))
    return tl.where(forced, float("inf"), ranked)


@triton.jit
def empty_top(ROWS: tl.constexpr, TOPK: tl.constexpr, KP: tl.constexpr):
    """An empty running top-k per row: ``(values [ROWS, KP] fp32, ids [ROWS, KP] int32 = -1)``.

    Slots past ``TOPK`` (KP is a power of two) hold +inf, so they are never the weakest and never
    replaced; free slots below ``TOPK`` hold -inf.
    """
    slot = tl.arange(0, KP)
    values = tl.where(slot[None, :] < TOPK, float("-inf"), float("inf")) + tl.zeros([ROWS, KP], tl.float32)
    return values, tl.full([ROWS, KP], -1, tl.int32)


@triton.jit
def keep_top(top_val, top_id, ranked, ids, KP: tl.constexpr):
    """Offer one candidate per row (``ranked [ROWS]``, ``ids`` a scalar or ``[ROWS, 1]``) to a running top-k.

    It replaces the row's weakest entry when strictly larger, so among equal keys the first offered
    stays; a -inf candidate is never taken.
    """
    slot = tl.arange(0, KP)
    weakest = tl.min(top_val, axis=1)
    weakest_slot = tl.argmin(top_val, axis=1)
    replace = (ranked > weakest)[:, None] & (slot[None, :] == weakest_slot[:, None])
    return tl.where(replace, ranked[:, None], top_val), tl.where(replace, ids, top_id)


@triton.jit
def order_bits(x):
    """fp32 ``x`` as int32 keys that order as the floats do (``-0.0`` taken as ``+0.0``)."""
    bits = (x + 0.0).to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def topk_ids_bitonic(ranked, blk, TOPK: tl.constexpr, KP: tl.constexpr, WIDTH: tl.constexpr):
    """Ids of the ``TOPK`` largest entries of ``ranked`` (1-D, ``WIDTH`` long), best first, -1 where
    fewer are finite-or-forced; equal keys rank the lower block first.

    One bitonic top-k (``tl.topk``) over 64-bit keys, the score's order bits above the reversed
    block id. Its compare-exchange stages work on every lane's keys at once, so it is short where
    :func:`topk_ids_serial` is a chain of ``TOPK`` dependent warp reductions; but it does more work
    in all (each stage exchanges every key). Alone on an H200: 1,024 blocks in 4.2 us on 4 warps
    against 8.5 us serial; 2,048 blocks 9.6 us on 8 warps against 8.6 serial, and at 64 requests x 4
    heads 20.9 against 13.4 (``benchmarks/results/decode_topk_bitonic_h200/``).
    """
    key = (order_bits(ranked).to(tl.int64) << 32) | (WIDTH - 1 - blk).to(tl.int64)
    top = tl.topk(key, KP)
    ids = WIDTH - 1 - (top & 0xFFFFFFFF).to(tl.int32)
    floor = order_bits(tl.full([KP], float("-inf"), tl.float32))
    slot = tl.arange(0, KP)
    return tl.where(((top >> 32).to(tl.int32) > floor) & (slot < TOPK), ids, -1)


@triton.jit
def topk_ids_serial(ranked, blk, TOPK: tl.constexpr, KP: tl.constexpr):
    """:func:`topk_ids_bitonic`'s result by one fused max+argmax reduction per pick.

    The picks loop at run time: unrolled sixteen times at each of the decode top-k's three widths,
    the top-k inside a whole step's graph, behind the attention kernel, took 19.4 us at B8 L128K
    against 9.6 us with only the index scan around it (H200; by every sign its code no longer stayed
    in the instruction cache; ``benchmarks/results/decode_topk_icache_h200/``).
    """
    slot = tl.arange(0, KP)
    chosen = tl.full([KP], -1, tl.int32)
    for i in range(TOPK):
        best, where_best = tl.max(ranked, 0, return_indices=True)
        chosen = tl.where(slot == i, tl.where(best > float("-inf"), where_best, -1), chosen)
        ranked = tl.where(blk == where_best, float("-inf"), ranked)
    return chosen


@triton.jit
def topk_ids(ranked, blk, TOPK: tl.constexpr, KP: tl.constexpr, WIDTH: tl.constexpr):
    """Ids of the ``TOPK`` largest entries of ``ranked``: bitonic up to ``BITONIC_MAX_WIDTH``
    blocks (short latency), serial picks past it (less work, where the keys no longer fit) and
    below ``KP`` (``tl.topk`` takes at most the row's length)."""
    if KP <= WIDTH and WIDTH <= BITONIC_MAX_WIDTH:
        return topk_ids_bitonic(ranked, blk, TOPK, KP, WIDTH)
    else:
        return topk_ids_serial(ranked, blk, TOPK, KP)


@triton.jit
def union_ids(ids, UP: tl.constexpr):
    """Sorted distinct ids of ``ids`` (1-D, -1 = empty), compacted to the front; and their count."""
    x = tl.sort(tl.where(ids < 0, _BIG, ids))
    pos = tl.arange(0, UP)
    same_earlier = (x[:, None] == x[None, :]) & (pos[None, :] < pos[:, None])
    duplicate = tl.max(same_earlier.to(tl.int32), axis=1) > 0
    x = tl.sort(tl.where(duplicate, _BIG, x))
    count = tl.sum((x < _BIG).to(tl.int32), 0)
    return tl.where(x == _BIG, -1, x), count


@triton.jit
def choose_blocks(
    score_ptr, sel_ptr, score_row, sel_row, own, live,
    WIDTH: tl.constexpr, TOPK: tl.constexpr, KP: tl.constexpr, LOCAL: tl.constexpr, INIT: tl.constexpr,
):
    """Forced blocks + top-k of one score row whose visible blocks all lie below ``WIDTH``."""
    blk = tl.arange(0, WIDTH)
    scores = tl.load(score_ptr + score_row + blk, mask=(blk <= own) & live, other=float("-inf"))
    ranked = forced_or_visible_scores(scores, blk, own, LOCAL, INIT)
    chosen = sort_ids(topk_ids(ranked, blk, TOPK, KP, WIDTH))
    slot = tl.arange(0, KP)
    tl.store(sel_ptr + sel_row + slot, chosen, mask=(slot < TOPK) & live)


@triton.jit
def decode_topk_kernel(
    score_ptr, sel_ptr,
    tile_tok0_ptr, tile_pos0_ptr, tile_ntok_ptr,
    s_sc_b, s_sc_r,
    s_sel_t, s_sel_h,
    NUM_HEADS: tl.constexpr, BLOCK: tl.constexpr, NBP: tl.constexpr,
    TOPK: tl.constexpr, KP: tl.constexpr, LOCAL: tl.constexpr, INIT: tl.constexpr,
    SHORT: tl.constexpr, MEDIUM: tl.constexpr, AFTER_PRIOR: tl.constexpr = False,
    TREE: tl.constexpr = False, depth_ptr=None,
):
    """Per (request, index head, query token): forced blocks + top-k of that token's scores.

    Each token selects on its own (speculative verification never shares a selection).
    A chain's token ``t`` sits at ``pos0 + t``; a draft tree's (``TREE``) at ``pos0 + depth``,
    its depth read from ``depth_ptr`` (last, with ``TREE``: chain launches leave both out).

    ``NBP`` covers the longest context the plan allows (a CUDA graph's: the model's whole
    context), but each token ranks only the ``SHORT``, ``MEDIUM`` or ``NBP`` first blocks, the
    narrowest width that holds its visible ones: the top-k's work grows with the width, and a
    graphed 2K-token decode would otherwise rank 2,048 blocks to pick among 16.

    ``AFTER_PRIOR`` (launched by programmatic dependent launch after the scan): read the plan's
    tiles, wait for the prior grid (``gdc_wait``), then let the attention launched the same way
    start its own preamble while this kernel ranks.
    """
    b = tl.program_id(0)
    h = tl.program_id(1)
    t = tl.program_id(2)
    tok0 = tl.load(tile_tok0_ptr + b)
    ntok = tl.load(tile_ntok_ptr + b)
    pos0 = tl.load(tile_pos0_ptr + b)
    if AFTER_PRIOR:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if TREE:
        pos = pos0 + tl.load(depth_ptr + tok0 + t, mask=t < ntok, other=0)
    else:
        pos = pos0 + t
    own = pos // BLOCK
    live = t < ntok
    score_row = b * s_sc_b + (t * NUM_HEADS + h) * s_sc_r
    sel_row = (tok0 + t) * s_sel_t + h * s_sel_h
    if own < SHORT:
        choose_blocks(score_ptr, sel_ptr, score_row, sel_row, own, live, SHORT, TOPK, KP, LOCAL, INIT)
    elif own < MEDIUM:
        choose_blocks(score_ptr, sel_ptr, score_row, sel_row, own, live, MEDIUM, TOPK, KP, LOCAL, INIT)
    else:
        choose_blocks(score_ptr, sel_ptr, score_row, sel_row, own, live, NBP, TOPK, KP, LOCAL, INIT)
