"""Triton kernel of the MSA main branch for extend batches: one query token per program, K/V by TMA.

The query-major prefill attention reads 16 blocks of K and V (64 KB in bf16) per (token, KV head)
for 16 query rows, so on random inputs it is bound by traffic from L2 (``benchmarks/
KERNEL_NOTES.md``). ``sparse_attention_kernel`` (``triton_attention``), which also serves decode,
verify and draft trees, computes a 128 x 128 tile of addresses for every K and V load and masks
every block by key range and position. Here a token's chosen blocks (sorted ascending) are split:
every block before the last lies wholly at or before the token (a block's keys run past the token
only in the token's own block, the newest one it can choose), so its K and V come in by tensor
descriptor (TMA on Hopper: one bulk copy per tile, no address registers) and are attended
unmasked; the last block is loaded and masked as before. On an H200 (random inputs, attention
alone, 4 KV heads, 3 stages and 4 warps) this took 3.12 against 3.43 ms at 8K new tokens, 14.4
against 15.4 ms at 32K, 61.2 against 65.9 ms at 128K and 2.17 against 2.28 ms for 4K after 124K;
with 2 stages it was even with the general kernel in that run
(``benchmarks/msa_prefill_attention_variants.py``, ``benchmarks/results/msa_prefill_attention_h200/``).

fp8 KV caches as in ``triton_attention``: K/V widened after the load, the K scale folded into
``qk_scale_log2`` by the launcher, the V scale on the normalised output.
"""

import triton
import triton.language as tl

from msa_kernels.triton_attention import _softmax_step
from msa_kernels.triton_select import TILE_POINTERS


@triton.jit(do_not_specialize=["s_pg_b"], do_not_specialize_on_alignment=TILE_POINTERS)
def prefill_attention_kernel(
    q_ptr, k_ptr, v_ptr, k_desc, v_desc, page_ptr, sel_ptr, out_ptr,
    tile_req_ptr, tile_tok0_ptr, tile_pos0_ptr,
    s_q_t, s_q_h,
    s_k_slot, s_k_h,
    s_v_slot, s_v_h,
    s_pg_b,
    s_sel_t, s_sel_h,
    s_o_t, s_o_h,
    qk_scale_log2, v_scale,
    G: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, TOPK: tl.constexpr, KP: tl.constexpr,
):
    """Program (tile, kv head), every tile one token: rows are the group's query heads (``G`` of
    ``ROWS``, padded to an MMA's height)."""
    tile = tl.program_id(0)
    h = tl.program_id(1)
    req = tl.load(tile_req_ptr + tile)
    tok = tl.load(tile_tok0_ptr + tile)
    pos = tl.load(tile_pos0_ptr + tile)
    g = tl.arange(0, ROWS)
    row_ok = g < G
    d = tl.arange(0, D)
    q = tl.load(q_ptr + tok * s_q_t + (h * G + g)[:, None] * s_q_h + d[None, :], mask=row_ok[:, None], other=0.0)
    list_ptr = sel_ptr + tok * s_sel_t + h * s_sel_h
    slot = tl.arange(0, KP)
    count = tl.sum((tl.load(list_ptr + slot, mask=slot < TOPK, other=-1) >= 0).to(tl.int32), 0)
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, D], tl.float32)
    for i in range(0, count - 1):  # wholly visible blocks: no mask
        page = tl.load(page_ptr + req * s_pg_b + tl.load(list_ptr + i))
        k = k_desc.load([page * BLOCK, h * D])
        s = tl.dot(q, tl.trans(k).to(q.dtype)) * qk_scale_log2
        v = v_desc.load([page * BLOCK, h * D])
        m_i, l_i, acc = _softmax_step(m_i, l_i, acc, s, v, q.dtype)
    # the newest chosen block: keys past the token are never read (they may hold garbage)
    blk = tl.load(list_ptr + count - 1)
    keys = tl.arange(0, BLOCK)
    key_ok = blk * BLOCK + keys <= pos
    slots = tl.load(page_ptr + req * s_pg_b + blk).to(tl.int64) * BLOCK + keys
    k_t = tl.load(k_ptr + slots[None, :] * s_k_slot + h * s_k_h + d[:, None], mask=key_ok[None, :], other=0.0)
    s = tl.where(key_ok[None, :], tl.dot(q, k_t.to(q.dtype)) * qk_scale_log2, float("-inf"))
    v = tl.load(v_ptr + slots[:, None] * s_v_slot + h * s_v_h + d[None, :], mask=key_ok[:, None], other=0.0)
    m_i, l_i, acc = _softmax_step(m_i, l_i, acc, s, v, q.dtype)
    o = acc / l_i[:, None] * v_scale
    tl.store(out_ptr + tok * s_o_t + (h * G + g)[:, None] * s_o_h + d[None, :], o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
