"""Triton kernels that group a block-major pass's (token, kv head, slot) pairs by key: a counting sort.

KV-block-major attention (``triton_block_major``) needs a pass's pairs grouped by
``key = head * num_pages + page`` and cut into tiles of at most ``PAIRS`` pairs of one key. A
``torch.sort`` of the keys plus tile tables from binary searches took 0.4-0.6 ms per pass, about
8 ms of a 128K prefill (benchmarks/KERNEL_NOTES.md, v8). Keys are small integers (fewer than
``kv_heads x pages``), so a counting sort does it in four short launches:

1. ``pair_keys_kernel``: each pair's key (-1 for a padded slot), a count per key, and per key
   the newest key offset any of its pairs may see and its block index;
2. ``bucket_scan_kernel`` (one program): exclusive sums of the counts and of the tiles per key,
   and the pass's tile count;
3. ``pair_scatter_kernel``: each pair to its key's range, by an atomic ticket;
4. ``tile_keys_kernel``: each tile's key, by a binary search over the keys' first tiles.

Within a key the pairs' order follows the tickets, so it may differ between runs; the attention
of a pair does not depend on its tile-mates (rows of an MMA are independent, and the held K/V is
masked by the key's newest offset, the same whatever the order), so outputs do not.
Buckets: one int32 row each of ``buckets[BUCKET_ROWS, kv_heads * num_pages]``, zeroed first.
"""

import triton
import triton.language as tl

# Rows of the bucket table (one entry per key each); constexpr so that kernels may read them.
COUNT, NEWEST, BLOCK_INDEX, PAIR_OFFSET, TILE_OFFSET, CURSOR = (tl.constexpr(row) for row in range(6))
BUCKET_ROWS = 6


# Lengths and the page table's width vary per batch: one compiled variant serves them all, so the
# one ``prepare.prepare_prefill`` builds is the one every batch uses.
@triton.jit(do_not_specialize=["tok_base", "num_tokens", "s_pt"])
def pair_keys_kernel(
    sel_ptr, page_table_ptr, tok_req_ptr, tok_pos_ptr, key_ptr, buckets_ptr,
    tok_base, num_tokens, num_pages,
    s_sel_t, s_sel_h, s_pt, s_bucket,
    HKV: tl.constexpr, TOPK: tl.constexpr, SLOTS: tl.constexpr, TOK: tl.constexpr, BLOCK: tl.constexpr,
):
    """``TOK`` tokens per program: their pairs' keys, and the counts, newest offsets and block indices per key.

    Pair ids are ``(token - tok_base) * HKV * TOPK + head * TOPK + slot``; ``SLOTS`` is
    ``HKV * TOPK`` rounded up to a power of two. A page is one block of the sequence, at the same
    index in every request sharing it, so every pair of a key stores the same block index.
    """
    t = tl.program_id(0) * TOK + tl.arange(0, TOK)
    j = tl.arange(0, SLOTS)
    t_ok = t < num_tokens
    ok = t_ok[:, None] & (j < HKV * TOPK)[None, :]
    tok = tok_base + t
    head = j // TOPK
    sel = tl.load(sel_ptr + tok[:, None] * s_sel_t + head[None, :] * s_sel_h + (j % TOPK)[None, :], mask=ok, other=-1)
    live = sel >= 0
    req = tl.load(tok_req_ptr + tok, mask=t_ok, other=0)
    page = tl.load(page_table_ptr + req[:, None] * s_pt + sel, mask=live, other=0)
    key = head[None, :] * num_pages + page
    pair = t[:, None] * (HKV * TOPK) + j[None, :]
    tl.store(key_ptr + pair, tl.where(live, key, -1), mask=ok)
    newest = tl.load(tok_pos_ptr + tok, mask=t_ok, other=0)[:, None] - sel * BLOCK
    tl.atomic_add(buckets_ptr + COUNT * s_bucket + key, 1, mask=live, sem="relaxed")
    tl.atomic_max(buckets_ptr + NEWEST * s_bucket + key, newest, mask=live, sem="relaxed")
    tl.store(buckets_ptr + BLOCK_INDEX * s_bucket + key, sel, mask=live)


@triton.jit
def bucket_scan_kernel(buckets_ptr, num_tiles_ptr, num_buckets, s_bucket, PAIRS: tl.constexpr, CHUNK: tl.constexpr):
    """One program: each key's first pair and first tile (exclusive sums), its scatter cursor, the tile count."""
    pair_carry = 0
    tile_carry = 0
    for b0 in range(0, num_buckets, CHUNK):
        b = b0 + tl.arange(0, CHUNK)
        ok = b < num_buckets
        count = tl.load(buckets_ptr + COUNT * s_bucket + b, mask=ok, other=0)
        tiles = (count + PAIRS - 1) // PAIRS
        pair_off = pair_carry + tl.cumsum(count, 0) - count
        tile_off = tile_carry + tl.cumsum(tiles, 0) - tiles
        tl.store(buckets_ptr + PAIR_OFFSET * s_bucket + b, pair_off, mask=ok)
        tl.store(buckets_ptr + CURSOR * s_bucket + b, pair_off, mask=ok)
        tl.store(buckets_ptr + TILE_OFFSET * s_bucket + b, tile_off, mask=ok)
        pair_carry += tl.sum(count, 0)
        tile_carry += tl.sum(tiles, 0)
    tl.store(num_tiles_ptr, tile_carry)


@triton.jit(do_not_specialize=["num_pairs"])
def pair_scatter_kernel(key_ptr, buckets_ptr, sorted_ptr, num_pairs, s_bucket, N: tl.constexpr):
    """``N`` pairs per program, each written into its key's range at a ticket from the key's cursor."""
    p = tl.program_id(0) * N + tl.arange(0, N)
    key = tl.load(key_ptr + p, mask=p < num_pairs, other=-1)
    live = key >= 0
    slot = tl.atomic_add(buckets_ptr + CURSOR * s_bucket + key, 1, mask=live, sem="relaxed")
    tl.store(sorted_ptr + slot, p, mask=live)


@triton.jit
def tile_keys_kernel(buckets_ptr, num_tiles_ptr, tile_key_ptr, num_buckets, search_steps, s_bucket, N: tl.constexpr):
    """``N`` tiles per program: each tile's key, the last key whose first tile is at or before it.

    Keys without pairs share their first tile with the next key that has some, so the *last* key
    at or before a tile is the one that owns it. ``search_steps`` >= log2(num_buckets + 1).
    """
    t = tl.program_id(0) * N + tl.arange(0, N)
    live = t < tl.load(num_tiles_ptr)
    lo = tl.zeros([N], dtype=tl.int32)
    hi = tl.full([N], num_buckets, dtype=tl.int32)
    for _ in range(search_steps):
        mid = (lo + hi) // 2
        probe = live & (lo < hi)
        first_tile = tl.load(buckets_ptr + TILE_OFFSET * s_bucket + mid, mask=probe, other=0)
        at_or_before = first_tile <= t
        lo = tl.where(probe & at_or_before, mid + 1, lo)
        hi = tl.where(probe & ~at_or_before, mid, hi)
    tl.store(tile_key_ptr + t, lo - 1, mask=live)
