"""Per-batch metadata for the MSA Triton kernels (the *plan* half of plan/run).

A plan turns SGLang's view of a batch (``req_to_token`` rows or a page table, sequence lengths,
prefix lengths, query lengths) into the small int32 tensors every layer's kernels read:

* ``page_table [batch, max_blocks]``: physical page of each logical 128-token block. The KV pool
  must use page size == MSA block size, so a block's tokens occupy the cache rows
  ``page * block_size + 0 .. block_size-1`` and one page id addresses a whole block.
* *tiles*: runs of consecutive query tokens of one request. ``tile_req`` (request), ``tile_tok0``
  (row of the first token in ``q``), ``tile_pos0`` (its absolute position) and ``tile_ntok``.
  Decode uses one tile per request (its ``q_len`` tokens); prefill uses small attention tiles and
  larger indexer tiles.
* *draft tree* (speculative verification of EAGLE trees, :class:`DraftTree`): a decode plan's
  ``q_len`` rows per request are the nodes of a token tree instead of a chain; each row carries
  its depth and its ancestors among the request's rows, and the rows' cache slots.

Decode plans are built from device tensors only (no host sync, fixed shapes for a given maximum
batch, query length and context), so they can be captured in a CUDA graph with the layers.
Prefill plans take host-side lengths (SGLang keeps ``extend_seq_lens_cpu``) because the number
of tiles depends on them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from msa_kernels.reference import MSAParams


@dataclass(frozen=True)
class Tiles:
    """Runs of consecutive query tokens of one request; all int32 ``[num_tiles]`` on the device."""

    req: torch.Tensor
    tok0: torch.Tensor
    pos0: torch.Tensor
    ntok: torch.Tensor
    max_tokens: int  # upper bound of ``ntok`` (a compile-time tile height)

    @property
    def count(self) -> int:
        return self.req.shape[0]


@dataclass(frozen=True)
class DraftTree:
    """The verify tokens of each request as a tree: all ``[batch * q_len]`` on the device, request-major.

    Row ``b * q_len + i`` is verify token ``i`` of request ``b``; token 0 is the root. A token
    is answered as a decode query would be once its root-to-token path is accepted: at position
    ``prefix + depth`` over the request's prefix (its ``tiles.pos0`` tokens) followed by its
    path, so ancestor ``a`` sits at position ``prefix + depth[a]`` and siblings are never seen.
    """

    depth: torch.Tensor  # int32: tokens above this one on its path (0 = root)
    ancestors: torch.Tensor  # int64: bit i set when token i of the request is on this token's path (itself included)
    slots: torch.Tensor  # int64: cache slot of this token (its K, V and index key)

    MAX_TOKENS = 64  # tokens per request that the ancestor bitmask can hold


def draft_tree(visible: torch.Tensor, slots: torch.Tensor) -> DraftTree:
    """A :class:`DraftTree` from each row's visible verify tokens (fixed shapes, no host sync).

    ``visible [batch * q_len, q_len]`` bool: row ``b * q_len + i`` marks the tokens of request
    ``b`` that token ``i`` attends (its root-to-token path); ``slots [batch * q_len]`` the tokens'
    cache slots. The depth is the path's length minus one (clamped to 0 for an empty row).
    """
    q_len = visible.shape[-1]
    _check_tree_width(q_len)
    bits = torch.ones((), dtype=torch.int64, device=visible.device) << torch.arange(q_len, device=visible.device)
    visible = visible.to(torch.int64)
    return DraftTree(
        depth=(visible.sum(dim=-1) - 1).clamp(min=0).to(torch.int32),
        ancestors=(visible * bits).sum(dim=-1),
        slots=slots.to(torch.int64).reshape(-1),
    )


def verify_window_slots(
    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor, q_len: int
) -> torch.Tensor:
    """Cache slots ``[batch * q_len]`` of the ``q_len`` tokens after each request's prefix.

    Read from ``req_to_token`` itself (columns clamped to its width), not from the page table,
    so no layout of the verify tokens' slots is assumed. Fixed shapes, no host sync.
    """
    columns = prefix_lens.long()[:, None] + torch.arange(q_len, device=prefix_lens.device)
    cells = req_to_token[req_pool_indices.long()[:, None], columns.clamp(max=req_to_token.shape[1] - 1)]
    return cells.reshape(-1).to(torch.int64)


@dataclass(frozen=True)
class DecodePlan:
    """Metadata of one decode / speculative-verify batch (``q_len`` tokens per request)."""

    params: MSAParams
    page_table: torch.Tensor  # [batch, max_blocks] int32
    tiles: Tiles  # one tile per request
    num_tokens: int  # rows of q (batch * max_q_len, padded rows are never written)
    max_blocks: int
    index_splits: int  # programs per request in the index scan over 16-bit index keys
    index_splits_fp8: int  # the same over fp8 index keys (fewer programs: see FP8_INDEX_PROGRAMS_PER_SM)
    attn_splits: int  # programs per (query token, kv head) in the sparse attention
    dense_splits: int  # programs per (query token, kv head) when a dense layer attends every block
    num_kv_heads: int
    # int32 zeros, one arrival counter per (query token, kv head): the attention runs every token
    # as its own tile, and the last of its splits to arrive merges the partial outputs and resets
    # the counter to 0.
    tickets: torch.Tensor
    # the rows of each request form a draft tree (speculative verification of EAGLE trees), or
    # None for a chain (row t at position pos0 + t attends every row before it)
    tree: DraftTree | None = None


@dataclass(frozen=True)
class PrefillPlan:
    """Metadata of one prefill / chunked-prefill (extend) batch."""

    params: MSAParams
    page_table: torch.Tensor  # [batch, max_blocks] int32
    index_tiles: Tiles  # indexer tiles, longest context first
    attn_tiles: Tiles  # query-major attention tiles, longest context first
    num_tokens: int
    max_blocks: int
    block_major: bool  # attention form: KV-block-major (long extends) or query-major (short ones)
    block_major_chunk: int  # tokens per block-major pass (bounds the partial-output scratch)
    block_major_programs: int  # persistent programs of the block-major attention (_BLOCK_MAJOR_PROGRAMS_PER_SM per SM)
    # [num_tokens] int32, request and absolute position of each q row; block-major only (else None)
    token_req: torch.Tensor | None
    token_pos: torch.Tensor | None
    # programs per indexer tile, each scanning a contiguous share of the tile's blocks; 1 = the
    # single-pass kernel, > 1 = split scan + merge launch
    index_splits: int


def page_table_from_req_to_token(
    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, max_context: int, block_size: int
) -> torch.Tensor:
    """Physical page per logical block, read off the first slot of every block.

    SGLang's paged allocator hands out whole pages, so slot ``s`` of a block lives in page
    ``s // page_size``; with page size == block size the first slot names the block's page.
    """
    if req_to_token.dim() != 2:
        raise ValueError(f"req_to_token must be [max_reqs, max_context], got shape {tuple(req_to_token.shape)}")
    if max_context > req_to_token.shape[1]:
        raise ValueError(f"max_context {max_context} exceeds req_to_token width {req_to_token.shape[1]}")
    first_slots = req_to_token[req_pool_indices.long(), 0:max_context:block_size]
    return (first_slots // block_size).to(torch.int32)


def _num_blocks(length: int, block_size: int) -> int:
    return (length + block_size - 1) // block_size


def _check_page_table(page_table: torch.Tensor, batch: int) -> None:
    if page_table.dim() != 2 or page_table.shape[0] != batch:
        raise ValueError(f"page_table must be [batch={batch}, max_blocks], got shape {tuple(page_table.shape)}")


#: Decode index-scan programs per SM over 16-bit keys, and over fp8 keys. At half the bytes per
#: block an fp8 program's fixed cost (query split, scales, pipeline fill) weighs twice as much, so
#: fewer programs that each scan more blocks are faster: the whole step with fp8 keys on an H200,
#: 32 -> 4 programs per SM, B8 L128K 80.0 -> 74.5 us, B32 L32K 99.3 -> 95.1, B64 L8K 118.8 -> 114.1,
#: B1 L32K even; over 16-bit keys 4 per SM is slower (B8 L128K 97.1 -> 109.5 us)
#: (``benchmarks/results/decode_fp8_scan_programs_h200/``).
INDEX_PROGRAMS_PER_SM = 32
FP8_INDEX_PROGRAMS_PER_SM = 4


def plan_decode(
    params: MSAParams,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    q_len: int = 1,
    q_lens: torch.Tensor | None = None,
    num_kv_heads: int = 4,
    num_sms: int = 132,
    index_programs_per_sm: int = INDEX_PROGRAMS_PER_SM,
    attn_programs_per_sm: int = 2,
    tree: DraftTree | None = None,
    fp8_index_programs_per_sm: int = FP8_INDEX_PROGRAMS_PER_SM,
) -> DecodePlan:
    """Plan a decode batch: request ``b`` holds ``seq_lens[b]`` tokens, the last ``q_lens[b]`` new.

    ``q`` rows are laid out request-major with a fixed stride of ``q_len`` rows per request
    (speculative verification sends ``q_len`` draft tokens per request); ``q_lens`` (device,
    each in 1..q_len) lets requests use fewer. ``page_table`` comes from
    :func:`page_table_from_req_to_token` and fixes the maximum context. ``num_kv_heads``,
    ``num_sms`` and the ``*_programs_per_sm`` knobs only size the grids, never the results.
    ``tree``: the new tokens form a draft tree (:class:`DraftTree`; every request verifies all
    ``q_len`` of them) rather than a chain.
    """
    batch = seq_lens.shape[0]
    if q_len < 1:
        raise ValueError(f"q_len must be >= 1, got {q_len}")
    device = seq_lens.device
    seq_lens = seq_lens.to(torch.int32)
    ntok = torch.full_like(seq_lens, q_len) if q_lens is None else q_lens.to(torch.int32)
    tiles = Tiles(
        req=torch.arange(batch, dtype=torch.int32, device=device),
        tok0=torch.arange(batch, dtype=torch.int32, device=device) * q_len,
        pos0=seq_lens - ntok,
        ntok=ntok,
        max_tokens=q_len,
    )
    return assemble_decode_plan(
        params,
        page_table.to(torch.int32).contiguous(),
        tiles,
        torch.zeros(batch * q_len * num_kv_heads, dtype=torch.int32, device=device),
        num_kv_heads,
        num_sms,
        index_programs_per_sm,
        attn_programs_per_sm,
        tree,
        fp8_index_programs_per_sm,
    )


def assemble_decode_plan(
    params: MSAParams,
    page_table: torch.Tensor,
    tiles: Tiles,
    tickets: torch.Tensor,
    num_kv_heads: int = 4,
    num_sms: int = 132,
    index_programs_per_sm: int = INDEX_PROGRAMS_PER_SM,
    attn_programs_per_sm: int = 2,
    tree: DraftTree | None = None,
    fp8_index_programs_per_sm: int = FP8_INDEX_PROGRAMS_PER_SM,
) -> DecodePlan:
    """A decode plan over tensors the caller owns, used as they are (no copy, no allocation).

    A CUDA graph keeps the addresses its kernels were captured with, so a caller that refreshes
    ``page_table``, ``tiles`` (and ``tree``) in place between replays builds its plan here once
    per shape. ``page_table`` must be int32 with unit stride along blocks (row stride is free);
    ``tickets`` int32 zeros, at least ``batch * q_len * num_kv_heads`` of them.
    """
    batch = tiles.count
    _check_page_table(page_table, batch)
    if tree is not None:
        _check_tree(tree, batch, tiles.max_tokens)
    if page_table.dtype != torch.int32 or page_table.stride(1) != 1:
        raise ValueError(f"page_table must be int32 with unit stride along blocks, got {page_table.dtype}, strides {page_table.stride()}")
    q_len = tiles.max_tokens
    needed = batch * q_len * num_kv_heads
    if tickets.dtype != torch.int32 or tickets.numel() < needed:
        raise ValueError(f"tickets must be >= {needed} int32 zeros, got {tickets.numel()} {tickets.dtype}")
    max_blocks = page_table.shape[1]
    index_splits = _scan_splits(index_programs_per_sm, num_sms, batch, max_blocks)
    index_splits_fp8 = _scan_splits(fp8_index_programs_per_sm, num_sms, batch, max_blocks)
    # The attention runs each query token as its own tile (a verify request's tokens too: each
    # reads only the blocks it chose, where one tile over the union of a request's choices
    # computes every block for all its tokens and needs a merge launch, KERNEL_NOTES.md);
    # tokens of one request that chose the same block read it at about the same time, from L2.
    per_split = batch * q_len * num_kv_heads
    splits = -(-attn_programs_per_sm * num_sms // per_split)
    attn_splits = max(1, min(params.topk, splits))
    # A dense layer reads up to every block of the table: as many programs, not more than one per block.
    dense_splits = max(1, min(max_blocks, splits))
    return DecodePlan(
        params=params,
        page_table=page_table,
        tiles=tiles,
        num_tokens=batch * q_len,
        max_blocks=max_blocks,
        index_splits=index_splits,
        index_splits_fp8=index_splits_fp8,
        attn_splits=attn_splits,
        dense_splits=dense_splits,
        num_kv_heads=num_kv_heads,
        tickets=tickets,
        tree=tree,
    )


def _check_tree_width(q_len: int) -> None:
    if q_len > DraftTree.MAX_TOKENS:
        raise ValueError(f"draft trees of {q_len} tokens per request: at most {DraftTree.MAX_TOKENS} are supported")


def _check_tree(tree: DraftTree, batch: int, q_len: int) -> None:
    _check_tree_width(q_len)
    rows = batch * q_len
    for name, dtype in (("depth", torch.int32), ("ancestors", torch.int64), ("slots", torch.int64)):
        x = getattr(tree, name)
        if x.dtype != dtype or x.shape != (rows,) or x.stride(0) != 1:
            raise ValueError(f"tree.{name} must be contiguous {dtype} [{rows}], got {x.dtype} {tuple(x.shape)}")


def _lengths_on(device: torch.device, *rows: list[int]) -> torch.Tensor:
    """Host integer lists as one int64 ``[len(rows), batch]`` tensor on ``device``, uploaded from
    page-locked memory without waiting (a pageable upload blocks the host until the GPU has
    drained everything queued before it)."""
    lens = torch.tensor(rows, dtype=torch.int64)
    if device.type == "cuda":
        lens = lens.pin_memory()
    return lens.to(device, non_blocking=True)


def _tiles_for(
    seq_lens: list[int], extend_lens: list[int], tile_tokens: int, device: torch.device
) -> Tiles:
    """Cut every request's new tokens into tiles of ``tile_tokens``; longest context first.

    Built on ``device`` from the lengths alone (one small asynchronous upload, a dozen small
    kernels, no host sync: the tile count is known on the host). An 8K-token chunk has 8,192
    one-token attention tiles; built on the host they held the GPU idle before every prefill
    chunk on an H100: 6-9 ms as a Python list with a pageable upload, about 3 ms as CPU tensor
    ops with a page-locked one (``benchmarks/prefill_host_probe.py``).
    """
    per_req_host = [-(-ext // tile_tokens) for ext in extend_lens]
    count = sum(per_req_host)
    ext, seq, per_req = _lengths_on(device, extend_lens, seq_lens, per_req_host)
    prefix = seq - ext
    req = torch.repeat_interleave(torch.arange(len(extend_lens), device=device), per_req, output_size=count)
    first_tile = torch.cumsum(per_req, 0) - per_req
    start = (torch.arange(count, device=device) - first_tile[req]) * tile_tokens
    ntok = (ext[req] - start).clamp(max=tile_tokens)
    tok0 = (torch.cumsum(ext, 0) - ext)[req] + start
    pos0 = prefix[req] + start
    # most work first, ties in request order: better tail balance
    order = torch.sort(pos0 + ntok, descending=True, stable=True).indices
    data = torch.stack((req, tok0, pos0, ntok))[:, order].to(torch.int32)
    return Tiles(req=data[0], tok0=data[1], pos0=data[2], ntok=data[3], max_tokens=tile_tokens)


# When the attention is KV-block-major: ``(new tokens, longest context)`` floors, either pair met.
# Block-major pays a grouping of the (token, block) pairs by block (a counting sort), a partial
# output per pair written and read back, and a merge; query-major re-reads each token's 16
# blocks, from L2 while the context's K/V fits there. On an H200 since the counting sort (whole
# extend step, random inputs, one request, alternating rounds; benchmarks/results/
# block_pair_counting_sort_h200/), in ms, block-major / query-major:
#   no prefix:  1K 0.378 / 0.285, 2K 0.713 / 0.626, 4K 1.317 / 1.457, 8K 2.85 / 3.22, 128K 59.1 / 76.2;
#   1K after 8K / 16K / 60K / 120K: 0.791 / 0.731, 0.832 / 0.763, 0.719 / 0.804, 0.974 / 1.036;
#   2K after the same: 1.157 / 1.198, 1.162 / 1.231, 1.238 / 1.474, 1.503 / 1.735;
#   4K and 8K after any of them: block-major by 16-25%.
BLOCK_MAJOR_FROM = ((4 * 1024, 0), (2 * 1024, 16 * 1024), (1024, 60 * 1024))
# Block-major passes of at most this many tokens: the partial outputs take
# tokens x kv_heads x topk x padded group x head_dim elements (2 GiB in bf16 at M3 geometry and
# 16K, a quarter of it per rank at TP 4 or more). With the counting sort the pass size barely
# matters: 8K passes took 59.6 ms at 128K against 59.1 for 16K (66.6 / 64.4 with torch.sort).
BLOCK_MAJOR_CHUNK_TOKENS = 16384
# Persistent block-major programs per SM: two programs of 64-row tiles (api._BLOCK_MAJOR_ROWS), so
# one's Q gathers overlap the other's math; 4 measured even (H200, block_major_held_kv_h200/).
_BLOCK_MAJOR_PROGRAMS_PER_SM = 2


def block_major_pays(new_tokens: int, longest_context: int) -> bool:
    """Whether a batch of ``new_tokens`` whose longest request reaches ``longest_context`` tokens
    takes the KV-block-major attention: it meets one of the ``BLOCK_MAJOR_FROM`` floors."""
    return any(new_tokens >= tokens and longest_context >= context for tokens, context in BLOCK_MAJOR_FROM)


def _token_positions(seq_lens: list[int], extend_lens: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Request and absolute position of every q row (rows packed request after request), built
    on ``device`` as :func:`_tiles_for` builds its tiles."""
    count = sum(extend_lens)
    ext, seq = _lengths_on(device, extend_lens, seq_lens)
    reqs = torch.repeat_interleave(torch.arange(len(seq_lens), device=device), ext, output_size=count)
    first_row = torch.cumsum(ext, 0) - ext
    pos = torch.arange(count, device=device) - first_row[reqs] + (seq - ext)[reqs]
    return reqs.to(torch.int32), pos.to(torch.int32)


# Index tiles per SM at which tiles alone fill the GPU, so splitting would only add a merge.
_INDEX_TILES_PER_SM_UNSPLIT = 2
# Index programs per SM the split form aims for: enough resident programs to hide load latency.
_INDEX_SPLIT_PROGRAMS_PER_SM = 4
# Blocks each split scans at least, so the scan outweighs its candidate write and merge share
# (at 32, an 8K prefill without prefix split in 2 and its indexer slowed 0.19 -> 0.24 ms, H100).
_MIN_BLOCKS_PER_INDEX_SPLIT = 64


def _scan_splits(programs_per_sm: int, num_sms: int, batch: int, max_blocks: int) -> int:
    """Programs per request of a decode index scan with ``programs_per_sm`` over the GPU (at most one per block)."""
    return max(1, min(max_blocks, (programs_per_sm * num_sms + batch - 1) // batch))


def _index_splits_for(num_tiles: int, max_blocks: int, num_sms: int) -> int:
    """Programs per indexer tile: 1 when tiles fill the GPU, else enough to fill it (capped by blocks)."""
    if num_tiles >= _INDEX_TILES_PER_SM_UNSPLIT * num_sms:
        return 1
    wanted = -(-_INDEX_SPLIT_PROGRAMS_PER_SM * num_sms // num_tiles)
    return max(1, min(wanted, max_blocks // _MIN_BLOCKS_PER_INDEX_SPLIT))


def plan_prefill(
    params: MSAParams,
    page_table: torch.Tensor,
    seq_lens: list[int],
    extend_lens: list[int],
    num_index_heads: int,
    attn_tile_tokens: int = 1,
    index_rows: int = 128,
    index_splits: int | None = None,
    num_sms: int = 132,
    block_major: bool | None = None,
    block_major_chunk: int = BLOCK_MAJOR_CHUNK_TOKENS,
) -> PrefillPlan:
    """Plan an extend batch: request ``b`` has ``seq_lens[b]`` tokens, the last ``extend_lens[b]`` new.

    ``q`` rows are packed request after request (SGLang's extend layout). The prefix length of a
    request is ``seq_lens[b] - extend_lens[b]`` and may be any value (not only multiples of the
    block size). ``index_rows`` is the indexer tile height in (token, index head) rows: 128 (halves
    the index-key reloads per row against 64; where 128-row tiles are too few to fill the GPU, a
    short chunk after a long prefix, splitting their key range beat 64-row tiles on an H100:
    4K after 124K 1.56 ms vs 1.72-1.97 ms, benchmarks/KERNEL_NOTES.md). ``index_splits`` is the
    number of programs that share each indexer tile's blocks (then merged); by default 1 when the
    tiles alone give ``_INDEX_TILES_PER_SM_UNSPLIT`` programs per SM, else enough for
    ``_INDEX_SPLIT_PROGRAMS_PER_SM`` with at least ``_MIN_BLOCKS_PER_INDEX_SPLIT`` blocks per split
    in the longest request.
    ``attn_tile_tokens`` query tokens share one attention program and load each block of their
    union once: worth it when neighbouring tokens choose alike; on random inputs every size above
    1 was slower on an H100 (benchmarks/KERNEL_NOTES.md), hence the default of 1.
    ``block_major`` picks the KV-block-major attention (default: :func:`block_major_pays`), run in
    passes of ``block_major_chunk`` tokens.
    """
    batch = len(seq_lens)
    if len(extend_lens) != batch:
        raise ValueError(f"extend_lens has {len(extend_lens)} entries, seq_lens has {batch}")
    _check_page_table(page_table, batch)
    for b, (s, e) in enumerate(zip(seq_lens, extend_lens)):
        if e < 1 or e > s:
            raise ValueError(f"request {b}: extend length {e} must be in 1..seq_len ({s})")
        if _num_blocks(s, params.block_size) > page_table.shape[1]:
            raise ValueError(f"request {b}: seq_len {s} needs more blocks than page_table has ({page_table.shape[1]})")
    if index_rows % num_index_heads:
        raise ValueError(f"index_rows {index_rows} must be a multiple of the index heads ({num_index_heads})")
    if block_major_chunk < 1:
        raise ValueError(f"block_major_chunk must be >= 1, got {block_major_chunk}")
    device = page_table.device
    num_tokens = sum(extend_lens)
    if block_major is None:
        block_major = block_major_pays(num_tokens, max(seq_lens))
    token_req, token_pos = _token_positions(seq_lens, extend_lens, device) if block_major else (None, None)
    index_tiles = _tiles_for(seq_lens, extend_lens, index_rows // num_index_heads, device)
    if index_splits is None:
        longest = max(_num_blocks(s, params.block_size) for s in seq_lens)
        index_splits = _index_splits_for(index_tiles.count, longest, num_sms)
    if index_splits < 1:
        raise ValueError(f"index_splits must be >= 1, got {index_splits}")
    return PrefillPlan(
        params=params,
        page_table=page_table.to(torch.int32).contiguous(),
        index_tiles=index_tiles,
        attn_tiles=_tiles_for(seq_lens, extend_lens, attn_tile_tokens, device),
        num_tokens=num_tokens,
        max_blocks=page_table.shape[1],
        block_major=block_major,
        block_major_chunk=block_major_chunk,
        block_major_programs=_BLOCK_MAJOR_PROGRAMS_PER_SM * num_sms,
        token_req=token_req,
        token_pos=token_pos,
        index_splits=index_splits,
    )
