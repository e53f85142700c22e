"""Triton kernels of the MSA main branch: GQA over the chosen blocks, and the split merge.

One program serves a *tile* (consecutive query tokens of one request) and one KV head: its rows
are (token, query head of the group). It walks the union of the blocks its tokens chose, loads
each block's K and V once for all of them, and masks per row the blocks that row's token did not
choose, plus the token-level causal mask. Prefill runs one program per tile. Decode runs every
query token as its own one-token tile (``TOKEN_TILES`` = the plan's q_len: a verify request's
tokens, chain or draft tree, each over the blocks it chose), splits those blocks over several
programs and merges their partial outputs by log-sum-exp in the last split to finish (an atomic
ticket per (tile, head)), saving a dependent launch.

``DENSE`` (M3's dense-attention layers in a decode / verify batch, the same plan): every block up
to a token's position is read, in order, instead of the blocks it chose; the rest is the same
(splits, merge, draft trees along their paths).

fp8 KV caches (SGLang's ``--kv-cache-dtype fp8_e4m3``: stored = value / scale, one scale per layer
for K and one for V): each K/V tile is widened to the query's dtype right after its load (exact),
so the MMAs run as for a 16-bit cache and accumulate in fp32; the K scale is folded into the
score scale ``qk_scale_log2`` by the launcher and the V scale multiplies the normalised output
(``v_scale``), which equals scaling every value since each output row is a convex combination.
"""

import triton
import triton.language as tl

from msa_kernels.triton_select import TILE_POINTERS, load_tile, union_ids
from msa_kernels.triton_tree import main_pass_limits


# Not specialized on batch-shaped values (see ``TILE_POINTERS``); without a draft tree the tree's
# three pointers are stand-ins that alias a tile tensor (``api._tree_args``), so neither are they.
@triton.jit(do_not_specialize=["s_pg_b"], do_not_specialize_on_alignment=TILE_POINTERS + ["depth_ptr", "anc_ptr", "tslot_ptr"])
def sparse_attention_kernel(
    q_ptr, k_ptr, v_ptr, page_ptr, sel_ptr, union_ptr,
    out_ptr, part_o_ptr, part_lse_ptr, ticket_ptr,
    tile_req_ptr, tile_tok0_ptr, tile_pos0_ptr, tile_ntok_ptr,
    depth_ptr, anc_ptr, tslot_ptr,
    s_q_t, s_q_h,
    s_k_slot, s_k_h,
    s_v_slot, s_v_h,
    s_pg_b,
    s_sel_t, s_sel_h,
    s_o_t, s_o_h,
    s_po_t, s_po_h, s_po_s, s_po_r,
    s_pl_t, s_pl_h, s_pl_s,
    qk_scale_log2, v_scale,
    G: tl.constexpr, GP: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
    TOPK: tl.constexpr, KP: tl.constexpr, UP: tl.constexpr, SPLITS: tl.constexpr, WRITE_PARTIAL: tl.constexpr,
    SINGLE_TOKEN: tl.constexpr, TREE: tl.constexpr, NW: tl.constexpr, WB: tl.constexpr,
    TOKEN_TILES: tl.constexpr = 1, DENSE: tl.constexpr = False, AFTER_PRIOR: tl.constexpr = False,
):
    """See the module docstring. ``TOKEN_TILES``: one-token tiles per tile of the tile tensors
    (the grid's first axis counts the one-token tiles; needs ``SINGLE_TOKEN``). ``TREE``
    (draft-tree verify, the tile tensors holding one tile per request): the chosen blocks are read
    up to the request's prefix (``j < pos0``), then the request's draft tokens are attended from
    their slots (``tslot``), each row only along its path (``anc`` bits), ancestor ``a`` counted
    in block ``(pos0 + depth[a]) // BLOCK`` (split 0 does that step; ``NW`` tokens at most,
    spanning ``WB`` blocks). ``AFTER_PRIOR`` (launched by programmatic dependent launch after the
    decode top-k): the tile and q are read, then the kernel waits for the prior grid before it
    reads the choice or writes anything (its scratch may reuse the scores' memory)."""
    tile = tl.program_id(0)  # with TOKEN_TILES > 1: token ``tile % TOKEN_TILES`` of request tile ``tile // TOKEN_TILES``
    h = tl.program_id(1)
    split = tl.program_id(2)
    request_tile = tile // TOKEN_TILES
    req = tl.load(tile_req_ptr + request_tile)
    req_tok0, pos0, req_ntok = load_tile(tile_tok0_ptr, tile_pos0_ptr, tile_ntok_ptr, request_tile)
    token = tile % TOKEN_TILES  # this tile's first token among its request tile's
    tok0 = req_tok0 + token
    ntok = req_ntok
    if TOKEN_TILES > 1:
        ntok = (token < req_ntok).to(tl.int32)
        if not TREE:  # a chain's token sits at pos0 + token; a tree's main pass reads the prefix before pos0
            pos0 += token
    rows = tl.arange(0, ROWS)
    t = rows // GP
    g = rows % GP
    row_ok = (t < ntok) & (g < G)
    last_pos, row_pos = main_pass_limits(pos0, ntok, t, TREE)  # a tree's own tokens come after the loop
    d = tl.arange(0, D)
    q = tl.load(q_ptr + (tok0 + t)[:, None] * s_q_t + (h * G + g)[:, None] * s_q_h + d[None, :], mask=row_ok[:, None], other=0.0)
    slot = tl.arange(0, KP)
    if AFTER_PRIOR:
        tl.extra.cuda.gdc_wait()
    if DENSE:  # no choice to read
        row_sel = tl.full([ROWS, KP], -1, tl.int32)
    else:
        row_sel = tl.load(
            sel_ptr + (tok0 + t)[:, None] * s_sel_t + h * s_sel_h + slot[None, :],
            mask=row_ok[:, None] & (slot[None, :] < TOPK),
            other=-1,
        )  # [ROWS, KP]: the blocks each row's token chose
    # The block list is read from memory inside the loop (not extracted from registers) so that
    # the software pipeliner can prefetch the next block's K/V while this one is computed.
    if DENSE:  # every block up to the token's newest key (a tile with no token has none)
        list_ptr = sel_ptr
        count = tl.where(ntok > 0, (last_pos + BLOCK) // BLOCK, 0)
    elif SINGLE_TOKEN:  # the token's own sorted choice, -1 padded
        list_ptr = sel_ptr + tok0 * s_sel_t + h * s_sel_h
        count = tl.sum((tl.max(row_sel, axis=0) >= 0).to(tl.int32), 0)
    else:  # union of the tile's choices, built in registers, staged in this program's scratch row
        u = tl.arange(0, UP)
        ut = u // TOPK
        picked = tl.load(sel_ptr + (tok0 + ut) * s_sel_t + h * s_sel_h + (u % TOPK), mask=ut < ntok, other=-1)
        union, count = union_ids(picked, UP)
        list_ptr = union_ptr + ((tile * tl.num_programs(1) + h) * SPLITS + split) * UP
        tl.store(list_ptr + u, union)
        tl.debug_barrier()
    keys = tl.arange(0, BLOCK)
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, D], tl.float32)
    for i in range(split, count, SPLITS):
        if DENSE:
            blk = i
        else:
            blk = tl.load(list_ptr + i)
        page = tl.load(page_ptr + req * s_pg_b + blk).to(tl.int64)
        kpos = blk * BLOCK + keys
        key_ok = kpos <= last_pos  # never touch rows past the newest token (may hold garbage)
        slots = page * BLOCK + keys
        k_t = tl.load(k_ptr + slots[None, :] * s_k_slot + h * s_k_h + d[:, None], mask=key_ok[None, :], other=0.0)
        s = tl.dot(q, k_t.to(q.dtype)) * qk_scale_log2
        allowed = kpos[None, :] <= row_pos[:, None]
        if not SINGLE_TOKEN:  # rows whose token did not choose this block of the union
            allowed = allowed & (tl.max((row_sel == blk).to(tl.int32), axis=1) > 0)[:, None]
        s = tl.where(allowed, s, float("-inf"))
        v = tl.load(v_ptr + slots[:, None] * s_v_slot + h * s_v_h + d[None, :], mask=key_ok[:, None], other=0.0)
        m_i, l_i, acc = _softmax_step(m_i, l_i, acc, s, v, q.dtype)
    if TREE:
        if split == 0:
            m_i, l_i, acc = _attend_tree_path(
                q, m_i, l_i, acc, k_ptr, v_ptr, depth_ptr, anc_ptr, tslot_ptr, row_sel, req_tok0, pos0, req_ntok, token + t, row_ok, h,
                s_k_slot, s_k_h, s_v_slot, s_v_h, qk_scale_log2, D, BLOCK, NW, WB, DENSE,
            )
    has_any = l_i > 0
    o = acc / tl.where(has_any, l_i, 1.0)[:, None] * v_scale
    if WRITE_PARTIAL:
        lse = tl.where(has_any, m_i + tl.log2(tl.where(has_any, l_i, 1.0)), float("-inf"))
        base = tile * s_po_t + h * s_po_h
        tl.store(part_o_ptr + base + split * s_po_s + rows[:, None] * s_po_r + d[None, :], o)
        lse_base = part_lse_ptr + tile * s_pl_t + h * s_pl_h + rows
        tl.store(lse_base + split * s_pl_s, lse)
        if SINGLE_TOKEN:
            tl.debug_barrier()  # every thread's partial stores precede the release of the ticket
            ticket = ticket_ptr + tile * tl.num_programs(1) + h
            if tl.atomic_add(ticket, 1, sem="acq_rel", scope="gpu") == SPLITS - 1:
                merge_splits(
                    part_o_ptr + base + rows[:, None] * s_po_r + d[None, :], lse_base, s_po_s, s_pl_s,
                    out_ptr + (tok0 + t)[:, None] * s_o_t + (h * G + g)[:, None] * s_o_h + d[None, :],
                    row_ok, ROWS, D, SPLITS,
                )
                tl.atomic_xchg(ticket, 0, sem="relaxed", scope="gpu")  # zero again for the next launch
    else:
        tl.store(
            out_ptr + (tok0 + t)[:, None] * s_o_t + (h * G + g)[:, None] * s_o_h + d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None],
        )


@triton.jit
def _attend_tree_path(
    q, m_i, l_i, acc, k_ptr, v_ptr, depth_ptr, anc_ptr, tslot_ptr, row_sel, tok0, pos0, ntok, t, row_ok, h,
    s_k_slot, s_k_h, s_v_slot, s_v_h, qk_scale_log2,
    D: tl.constexpr, BLOCK: tl.constexpr, NW: tl.constexpr, WB: tl.constexpr, DENSE: tl.constexpr = False,
):
    """One more online-softmax step over a draft tree's tokens: row (token t of the request's
    ``ntok`` from row ``tok0`` on) attends token ``i`` when ``i`` is on its path and the row chose
    the block of ``i``'s position ``pos0 + depth[i]`` (``DENSE``: every block counts as chosen)."""
    i = tl.arange(0, NW)
    i_ok = i < ntok
    slots = tl.load(tslot_ptr + tok0 + i, mask=i_ok, other=0)
    ancestors = tl.load(anc_ptr + tok0 + t, mask=row_ok, other=0)
    allowed = (((ancestors[:, None] >> i[None, :].to(tl.int64)) & 1) != 0) & i_ok[None, :]
    if not DENSE:
        blk_of = (pos0 + tl.load(depth_ptr + tok0 + i, mask=i_ok, other=0)) // BLOCK
        chose = tl.zeros(allowed.shape, tl.int1)
        for w in tl.static_range(WB):
            blk = pos0 // BLOCK + w
            chose_blk = tl.max((row_sel == blk).to(tl.int32), axis=1) > 0
            chose = chose | (chose_blk[:, None] & (blk_of == blk)[None, :])
        allowed = allowed & chose
    d = tl.arange(0, D)
    k_t = tl.load(k_ptr + slots[None, :] * s_k_slot + h * s_k_h + d[:, None], mask=i_ok[None, :], other=0.0)
    s = tl.where(allowed, tl.dot(q, k_t.to(q.dtype)) * qk_scale_log2, float("-inf"))
    v = tl.load(v_ptr + slots[:, None] * s_v_slot + h * s_v_h + d[None, :], mask=i_ok[:, None], other=0.0)
    return _softmax_step(m_i, l_i, acc, s, v, q.dtype)


@triton.jit
def _softmax_step(m_i, l_i, acc, s, v, dtype: tl.constexpr):
    """Online softmax (base 2): fold scores ``s [ROWS, keys]`` (-inf = masked) and values ``v``
    into the running max ``m_i``, sum ``l_i`` and output ``acc``."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc * alpha[:, None] + tl.dot(p.to(dtype), v.to(dtype))


@triton.jit
def merge_splits(
    part_o_ptrs, part_lse_ptrs, s_po_s, s_pl_s, out_ptrs, row_ok,
    ROWS: tl.constexpr, D: tl.constexpr, splits,
):
    """out = sum_s w_s * o_s over the first ``splits`` partials, w_s = 2^(lse_s - lse_total) (base 2).

    The partials may have been written by other programs of the same launch: read past L1.
    """
    m = tl.full([ROWS], float("-inf"), tl.float32)
    for s in range(splits):
        m = tl.maximum(m, tl.load(part_lse_ptrs + s * s_pl_s, cache_modifier=".cg"))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    total = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, D], tl.float32)
    for s in range(splits):
        w = tl.exp2(tl.load(part_lse_ptrs + s * s_pl_s, cache_modifier=".cg") - m_safe)
        acc += w[:, None] * tl.load(part_o_ptrs + s * s_po_s, cache_modifier=".cg")
        total += w
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(out_ptrs, out.to(out_ptrs.dtype.element_ty), mask=row_ok[:, None])
