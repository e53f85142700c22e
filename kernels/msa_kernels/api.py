"""Launchers of the MSA Triton kernels: the *run* half of plan/run (see the package docstring)."""

from __future__ import annotations

import dataclasses
import functools
import math
import os

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from msa_kernels import triton_pair_plan
from msa_kernels.plan import DecodePlan, DraftTree, PrefillPlan, Tiles
from msa_kernels.triton_attention import sparse_attention_kernel
from msa_kernels.triton_block_major import block_major_attention_kernel, merge_block_partials_kernel
from msa_kernels.triton_index import (
    decode_index_scores_kernel,
    prefill_index_merge_kernel,
    prefill_index_topk_kernel,
    tree_window_scores_kernel,
)
from msa_kernels.triton_prefill_attention import prefill_attention_kernel
from msa_kernels.triton_select import BITONIC_MAX_WIDTH, decode_topk_kernel

_LOG2E = 1.4426950408889634

#: Element types an fp8 main KV cache may hold (SGLang's ``--kv-cache-dtype fp8_e4m3`` / ``fp8_e5m2``).
FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
#: KV cache element types whose extend attention loads by tensor descriptor on a GPU.
_DESCRIPTOR_GPU_DTYPES = (torch.bfloat16, torch.float16)
#: ``0`` launches a decode step's three kernels one after the other instead of chained
#: (:func:`run_decode`); any other value, or none, chains them where the GPU can.
DECODE_CHAIN_ENV = "MSA_DECODE_CHAINED_LAUNCH"


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, n))


def _check_inputs(q, k_cache, v_cache, iq, ik_cache, num_tokens: int, block_size: int) -> None:
    """Validate shapes before any launch; the error names the argument at fault."""
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("iq", iq), ("ik_cache", ik_cache)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    if q.dim() != 3 or q.shape[0] < num_tokens:
        raise ValueError(f"q must be [tokens>={num_tokens}, q_heads, head_dim], got {tuple(q.shape)}")
    if k_cache.dim() != 3 or v_cache.shape[:2] != k_cache.shape[:2]:
        raise ValueError(f"k_cache/v_cache must be [slots, kv_heads, dim], got {tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
    hkv = k_cache.shape[1]
    if q.shape[1] % hkv:
        raise ValueError(f"q heads ({q.shape[1]}) must be a multiple of kv heads ({hkv})")
    if iq.dim() != 3 or iq.shape[1] != hkv:
        raise ValueError(f"iq must be [tokens, index_heads == kv_heads ({hkv}), index_dim], got {tuple(iq.shape)}")
    if ik_cache.shape[-1] != iq.shape[-1] or ik_cache.numel() // ik_cache.shape[-1] != ik_cache.shape[0]:
        raise ValueError(f"ik_cache must be [slots, index_dim] or [slots, 1, index_dim], got {tuple(ik_cache.shape)}")
    if k_cache.shape[0] % block_size:
        raise ValueError(f"cache slots ({k_cache.shape[0]}) must be whole pages of {block_size}")
    if q.shape[-1] != k_cache.shape[-1] or v_cache.shape[-1] != q.shape[-1]:
        raise ValueError("q, k_cache and v_cache must share head_dim")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dtype != q.dtype and cache.dtype not in FP8_KV_DTYPES:
            raise ValueError(f"{name} must hold q's dtype ({q.dtype}) or fp8 (float8_e4m3fn, float8_e5m2), got {cache.dtype}")


def _check_kv_scales(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: float, v_scale: float) -> None:
    """Per-layer K/V scales belong to an fp8 cache; a 16-bit or fp32 cache holds the values themselves."""
    for name, cache, value in (("k_scale", k_cache, k_scale), ("v_scale", v_cache, v_scale)):
        if not value > 0 or value == float("inf"):
            raise ValueError(f"{name} must be a positive finite float, got {value}")
        if value != 1.0 and cache.dtype not in FP8_KV_DTYPES:
            raise ValueError(f"{name} = {value} is for an fp8 KV cache, the cache holds {cache.dtype}")


def _check_index_scale(ik_cache: torch.Tensor, ik_scale: torch.Tensor | None) -> None:
    """fp8 index keys come with one fp32 scale per slot, and only they do."""
    fp8 = ik_cache.dtype == torch.float8_e4m3fn
    if fp8 and ik_scale is None:
        raise ValueError("ik_cache holds float8_e4m3fn keys: pass their per-slot scales as ik_scale")
    if not fp8 and ik_scale is not None:
        raise ValueError(f"ik_scale is for float8_e4m3fn index keys, ik_cache is {ik_cache.dtype}")
    if fp8 and (ik_scale.dtype != torch.float32 or ik_scale.shape != (ik_cache.shape[0],) or ik_scale.stride(0) != 1):
        raise ValueError(
            f"ik_scale must be contiguous float32 [{ik_cache.shape[0]}] (one scale per slot), "
            f"got {ik_scale.dtype} {tuple(ik_scale.shape)}"
        )


def _tile_args(tiles: Tiles):
    return tiles.req, tiles.tok0, tiles.pos0, tiles.ntok


def _tree_args(tree: DraftTree | None, tiles: Tiles, block_size: int):
    """The tree's tensors and constexprs for the kernels that take them.

    ``NW``: a request's tokens padded to a power of two, at least 16 (an MMA dimension); ``WB``:
    the blocks that positions ``pos0 .. pos0 + q_len - 1`` may span. Without a tree, stand-ins
    that are never read and fixed values (no extra kernel variants).
    """
    if tree is None:
        return (tiles.tok0, tiles.tok0, tiles.tok0), dict(TREE=False, NW=16, WB=1)
    q_len = tiles.max_tokens
    return (tree.depth, tree.ancestors, tree.slots), dict(
        TREE=True, NW=max(16, _pow2(q_len)), WB=(block_size + q_len - 2) // block_size + 1
    )


def _attention_strides(q, k_cache, v_cache, page_table, selected, out) -> tuple[int, ...]:
    """The strides both query-major attention kernels take, in their parameter order."""
    return (
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        page_table.stride(0), selected.stride(0), selected.stride(1), out.stride(0), out.stride(1),
    )


def _attention(
    plan_tiles: Tiles, page_table, q, k_cache, v_cache, selected, out, splits: int, sm_scale: float, block_size: int,
    tickets: torch.Tensor | None = None, k_scale: float = 1.0, v_scale: float = 1.0, tree: DraftTree | None = None,
    per_token: bool = False, dense: bool = False, chained: bool = False,
) -> None:
    """Sparse GQA over each tile's union of chosen blocks; split + LSE merge when ``splits > 1``.

    ``k_scale`` / ``v_scale``: an fp8 cache's per-layer scales (values = stored * scale).
    ``tree``: the tiles are requests whose tokens form draft trees (decode plans only).
    ``per_token`` (decode plans): each tile's ``max_tokens`` tokens attend as one-token tiles.
    ``dense`` (one-token tiles): every block up to each token's position, ``selected`` unread.
    ``chained``: launched by programmatic dependent launch after the kernel that wrote ``selected``.

    Splits need one-token tiles: the merge runs in the last-arriving split program of each
    (tile, kv head), counted in ``tickets`` (int32 zeros, ``tiles x kv_heads``, left zero
    afterwards).
    """
    token_tiles = plan_tiles.max_tokens if per_token else 1
    num_tiles = plan_tiles.count * token_tiles
    tile_tokens = plan_tiles.max_tokens // token_tiles
    if (splits > 1 or dense) and tile_tokens > 1:
        raise ValueError(f"split and dense attention need one-token tiles, got tiles of {tile_tokens} tokens")
    hkv = k_cache.shape[1]
    group = q.shape[1] // hkv
    gp = _pow2(group)
    rows = max(16, tile_tokens * gp)
    topk = 1 if dense else selected.shape[-1]  # a dense tile reads no choice
    d = q.shape[-1]
    partial = splits > 1
    union_slots = _pow2(tile_tokens * topk)
    single = tile_tokens == 1
    union = torch.empty(1 if single else num_tiles * hkv * splits * union_slots, dtype=torch.int32, device=q.device)
    if partial:
        part_o = torch.empty(num_tiles, hkv, splits, rows, d, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_tiles, hkv, splits, rows, dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = torch.empty(1, 1, 1, 1, dtype=torch.float32, device=q.device)
    if partial and (tickets is None or tickets.numel() < num_tiles * hkv):
        raise ValueError(f"split attention needs {num_tiles * hkv} zeroed int32 tickets")
    tree_tensors, tree_flags = _tree_args(tree, plan_tiles, block_size)
    sparse_attention_kernel[(num_tiles, hkv, splits)](
        q, k_cache, v_cache, page_table, selected, union,
        out, part_o, part_lse, tickets if partial else union,
        *_tile_args(plan_tiles),
        *tree_tensors,
        *_attention_strides(q, k_cache, v_cache, page_table, selected, out),
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_o.stride(3),
        part_lse.stride(0), part_lse.stride(1), part_lse.stride(2),
        sm_scale * k_scale * _LOG2E, v_scale,
        G=group, GP=gp, ROWS=rows, D=d, BLOCK=block_size,
        TOPK=topk, KP=_pow2(topk), UP=union_slots, SPLITS=splits, WRITE_PARTIAL=partial,
        SINGLE_TOKEN=single, **tree_flags, TOKEN_TILES=token_tiles, DENSE=dense, AFTER_PRIOR=chained,
        num_warps=4 if rows <= 64 else 8, num_stages=2, launch_pdl=chained,
    )


# Query rows per block-major tile ((token, slot) pairs x query heads of the group), the warps of
# its program and its pipeline stages. The fastest of the launches swept on an H200 since a key's
# K/V is held over its run of tiles: 64-row tiles on 4 warps, two programs per SM (attention at 128K
# 50.1 ms against 58.9 for 128-row tiles on 8 warps, one per SM; benchmarks/results/
# block_major_held_kv_h200/). Before, each tile loaded its K/V and larger tiles won.
_BLOCK_MAJOR_ROWS = 64
_BLOCK_MAJOR_WARPS = 4
_BLOCK_MAJOR_STAGES = 2


# Tokens per program of the pair-key kernel, pairs per program of the scatter, tiles per program of
# the tile-key search, and buckets per step of the one-program scan.
_PAIR_KEY_TOKENS = 16
_PAIR_SCATTER_PAIRS = 1024
_TILE_KEY_TILES = 512
_BUCKET_SCAN_CHUNK = 4096


@dataclasses.dataclass(frozen=True)
class BlockPairs:
    """A block-major pass's pairs grouped by key (``triton_pair_plan``): ``buckets`` (the table of
    per-key rows), ``pairs`` (pair ids, key after key), ``tile_key`` (each tile's key) and
    ``num_tiles`` (a one-element device tensor: nothing waits for the host)."""

    buckets: torch.Tensor
    pairs: torch.Tensor
    tile_key: torch.Tensor
    num_tiles: torch.Tensor


def _group_pairs(
    page_table: torch.Tensor, token_req: torch.Tensor, token_pos: torch.Tensor, selected: torch.Tensor,
    tok_base: int, num_tokens: int, num_pages: int, block_size: int, pairs_per_tile: int,
) -> BlockPairs:
    """Group the pairs of tokens ``tok_base ..`` ``+ num_tokens`` by ``key = head * num_pages + page``
    with a counting sort (four launches, no host sync), cut into tiles of ``pairs_per_tile``."""
    hkv, topk = selected.shape[1], selected.shape[2]
    num_buckets = hkv * num_pages
    num_pairs = num_tokens * hkv * topk
    device = selected.device
    buckets = torch.zeros(triton_pair_plan.BUCKET_ROWS, num_buckets, dtype=torch.int32, device=device)
    keys = torch.empty(num_pairs, dtype=torch.int32, device=device)
    pairs = torch.empty(num_pairs, dtype=torch.int32, device=device)
    max_tiles = min(num_pairs, num_pairs // pairs_per_tile + num_buckets)
    tile_key = torch.empty(max_tiles, dtype=torch.int32, device=device)
    num_tiles = torch.empty(1, dtype=torch.int32, device=device)
    triton_pair_plan.pair_keys_kernel[(triton.cdiv(num_tokens, _PAIR_KEY_TOKENS),)](
        selected, page_table, token_req, token_pos, keys, buckets,
        tok_base, num_tokens, num_pages,
        selected.stride(0), selected.stride(1), page_table.stride(0), buckets.stride(0),
        HKV=hkv, TOPK=topk, SLOTS=_pow2(hkv * topk), TOK=_PAIR_KEY_TOKENS, BLOCK=block_size,
    )
    triton_pair_plan.bucket_scan_kernel[(1,)](
        buckets, num_tiles, num_buckets, buckets.stride(0), PAIRS=pairs_per_tile, CHUNK=_BUCKET_SCAN_CHUNK,
    )
    triton_pair_plan.pair_scatter_kernel[(triton.cdiv(num_pairs, _PAIR_SCATTER_PAIRS),)](
        keys, buckets, pairs, num_pairs, buckets.stride(0), N=_PAIR_SCATTER_PAIRS,
    )
    triton_pair_plan.tile_keys_kernel[(triton.cdiv(max_tiles, _TILE_KEY_TILES),)](
        buckets, num_tiles, tile_key, num_buckets, num_buckets.bit_length(), buckets.stride(0), N=_TILE_KEY_TILES,
    )
    return BlockPairs(buckets=buckets, pairs=pairs, tile_key=tile_key, num_tiles=num_tiles)


def _attention_block_major(
    plan: PrefillPlan, q, k_cache, v_cache, selected, out, sm_scale: float, block_size: int,
    k_scale: float = 1.0, v_scale: float = 1.0, tokens: tuple[int, int] | None = None,
) -> None:
    """KV-block-major sparse GQA (see ``triton_block_major``), in passes of ``plan.block_major_chunk``
    tokens; ``tokens = (first, last)``: only those rows of the batch."""
    hkv, d = k_cache.shape[1], q.shape[-1]
    group = q.shape[1] // hkv
    gp = _pow2(group)
    topk = selected.shape[-1]
    pairs_per_tile = max(1, _BLOCK_MAJOR_ROWS // gp)
    num_pages = k_cache.shape[0] // block_size
    first, last = (0, plan.num_tokens) if tokens is None else tokens
    chunk = min(plan.block_major_chunk, last - first)
    part_o = torch.empty(chunk * hkv * topk, gp, d, dtype=q.dtype, device=q.device)
    part_lse = torch.empty(chunk * hkv * topk, gp, dtype=torch.float32, device=q.device)
    for start in range(first, last, chunk):
        n = min(chunk, last - start)
        grouped = _group_pairs(
            plan.page_table, plan.token_req, plan.token_pos, selected, start, n, num_pages, block_size, pairs_per_tile
        )
        programs = min(triton.cdiv(n * hkv * topk, pairs_per_tile), plan.block_major_programs)
        block_major_attention_kernel[(programs,)](
            q, k_cache, v_cache, plan.token_pos, grouped.pairs, grouped.tile_key, grouped.buckets, grouped.num_tiles,
            part_o, part_lse,
            start, num_pages,
            q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1),
            v_cache.stride(0), v_cache.stride(1),
            grouped.buckets.stride(0),
            part_o.stride(0), part_o.stride(1),
            part_lse.stride(0),
            sm_scale * k_scale * _LOG2E, v_scale,
            HKV=hkv, TOPK=topk, G=group, GP=gp, PAIRS=pairs_per_tile, D=d, BLOCK=block_size,
            num_warps=_BLOCK_MAJOR_WARPS, num_stages=_BLOCK_MAJOR_STAGES,
        )
        merge_block_partials_kernel[(n, hkv)](
            part_o, part_lse, selected, out,
            start,
            part_o.stride(0), part_o.stride(1),
            part_lse.stride(0),
            selected.stride(0), selected.stride(1),
            out.stride(0), out.stride(1),
            HKV=hkv, TOPK=topk, KP=_pow2(topk), G=group, GP=gp, D=d,
            num_warps=4,
        )


def _scale(sm_scale: float | None, head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale


def topk_widths(nbp: int) -> dict[str, int]:
    """The decode top-k's narrower widths (blocks ranked) below its full ``nbp``: a sixteenth and a
    quarter of it, at least 16 blocks (a graph of a 128K context: 128 and 512 of 2,048)."""
    short = max(16, nbp // 16)
    return {"SHORT": short, "MEDIUM": max(short, nbp // 4)}


def topk_num_warps(nbp: int) -> int:
    """Warps of the decode top-k over ``nbp`` blocks. Up to ``BITONIC_MAX_WIDTH`` every width is
    ranked bitonically: 4 warps (its 64-bit keys spill past about 8 per thread: 1,024 blocks took
    12.6 us on one warp, 4.2 us on four). Past it the widest rows take the serial picks, which
    want few warps (fewer block barriers per pick): at most 32 scores per thread, as before."""
    return 4 if nbp <= BITONIC_MAX_WIDTH else min(16, nbp // 1024)


def decode_select(
    plan: DecodePlan, iq: torch.Tensor, ik_cache: torch.Tensor, ik_scale: torch.Tensor | None = None,
    chained: bool = False,
) -> torch.Tensor:
    """Chosen blocks ``[batch*q_len, kv_heads, topk]`` (int32, ascending, -1 padded) of a decode batch.

    ``ik_scale [slots]``: fp32 per-slot scales when ``ik_cache`` holds float8_e4m3fn keys.
    ``chained`` (Hopper on): the top-k is launched by programmatic dependent launch, so it is
    resident and waiting when the scan ends, and lets a chained attention start its preamble.

    Two kernels: the index scan (keys on the MMA's M side, split over blocks) writes one fp32
    block-max per (request, row, block); the top-k runs one small program per (request, head, token).
    (Folding the top-k into the scan's last program measured slower: KERNEL_NOTES.md v7.)
    A draft tree (``plan.tree``) adds one launch between them: the scan covers each request's
    prefix, then every token's own path is scored into the blocks its positions fall in.
    """
    p = plan.params
    tiles = plan.tiles
    batch, t = tiles.count, tiles.max_tokens
    hkv, di = iq.shape[1], iq.shape[-1]
    ik2 = ik_cache.reshape(ik_cache.shape[0], di)
    _check_index_scale(ik2, ik_scale)
    score_rows = max(16, _pow2(hkv * t))
    scores = torch.empty(batch, score_rows, plan.max_blocks, dtype=torch.float32, device=iq.device)
    splits = plan.index_splits if ik_scale is None else plan.index_splits_fp8
    decode_index_scores_kernel[(batch, splits)](
        iq, ik2, ik2 if ik_scale is None else ik_scale, plan.page_table, scores,
        tiles.tok0, tiles.pos0, tiles.ntok,
        iq.stride(0), iq.stride(1),
        ik2.stride(0),
        plan.page_table.stride(0),
        scores.stride(0), scores.stride(1),
        NUM_HEADS=hkv, ROWS=score_rows, D=di, BLOCK=p.block_size, SPLITS=splits,
        KEY_FP8=ik_scale is not None, QUERY_TERMS=ik_scale is not None and iq.dtype == torch.bfloat16,
        TREE=plan.tree is not None, EARLY_DEPENDENTS=chained and plan.tree is None,
        num_warps=4, num_stages=2,
    )
    tree = plan.tree
    if tree is not None:
        tree_tensors, tree_flags = _tree_args(tree, tiles, p.block_size)
        tree_window_scores_kernel[(batch, hkv, t)](
            iq, ik2, ik2 if ik_scale is None else ik_scale, scores,
            tiles.tok0, tiles.pos0, tiles.ntok,
            *tree_tensors,
            iq.stride(0), iq.stride(1),
            ik2.stride(0),
            scores.stride(0), scores.stride(1),
            NUM_HEADS=hkv, D=di, BLOCK=p.block_size, NW=tree_flags["NW"], WB=tree_flags["WB"],
            KEY_FP8=ik_scale is not None,
            num_warps=4,
        )
    selected = torch.empty(plan.num_tokens, hkv, p.topk, dtype=torch.int32, device=iq.device)
    nbp = _pow2(plan.max_blocks)
    decode_topk_kernel[(batch, hkv, t)](
        scores, selected,
        tiles.tok0, tiles.pos0, tiles.ntok,
        scores.stride(0), scores.stride(1),
        selected.stride(0), selected.stride(1),
        NUM_HEADS=hkv, BLOCK=p.block_size, NBP=nbp,
        TOPK=p.topk, KP=_pow2(p.topk), LOCAL=p.local_blocks, INIT=p.init_blocks,
        **topk_widths(nbp), AFTER_PRIOR=chained,
        TREE=tree is not None, depth_ptr=None if tree is None else tree.depth,
        num_warps=topk_num_warps(nbp), launch_pdl=chained,
    )
    return selected


def run_decode(
    plan: DecodePlan,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    iq: torch.Tensor,
    ik_cache: torch.Tensor,
    sm_scale: float | None = None,
    out: torch.Tensor | None = None,
    ik_scale: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sparse layer's decode step: index scan, top-k, split sparse attention (+ merge when q_len > 1).

    ``q [batch*q_len, q_heads, D]``, ``iq [batch*q_len, kv_heads, Di]`` (request-major rows),
    ``k_cache/v_cache [slots, kv_heads, D]`` in q's dtype, or fp8 (SGLang's fp8 KV cache) whose
    values are ``k_cache * k_scale`` and ``v_cache * v_scale`` (per-layer floats, 1.0 by default),
    ``ik_cache [slots, Di]`` (or ``[slots, 1, Di]``),
    bf16/fp32 or float8_e4m3fn with its fp32 per-slot scales ``ik_scale [slots]``.
    Returns ``(out [batch*q_len, q_heads, D], selected [batch*q_len, kv_heads, topk] int32)``;
    rows of padded tokens (``q_lens[b] < q_len``) are left unwritten.
    """
    p = plan.params
    _check_inputs(q, k_cache, v_cache, iq, ik_cache, plan.num_tokens, p.block_size)
    _check_kv_scales(k_cache, v_cache, k_scale, v_scale)
    if k_cache.shape[1] != plan.num_kv_heads:
        raise ValueError(f"k_cache has {k_cache.shape[1]} kv heads, the plan was made for {plan.num_kv_heads}")
    chained = chains_decode_launches(q.device)
    selected = decode_select(plan, iq, ik_cache, ik_scale, chained=chained)
    out = decode_attention(plan, q, k_cache, v_cache, selected, out, sm_scale, k_scale, v_scale, chained=chained)
    return out, selected


def chains_decode_launches(device: torch.device) -> bool:
    """Whether :func:`run_decode` chains its kernels by programmatic dependent launch: on a Hopper
    or later GPU unless ``MSA_DECODE_CHAINED_LAUNCH=0``. Each chained kernel is resident and past
    its preamble when the one before it ends, instead of launching then."""
    return device.type == "cuda" and _hopper_or_later(device) and os.environ.get(DECODE_CHAIN_ENV, "1") != "0"


def _check_page_table_like(plan_table: torch.Tensor, page_table: torch.Tensor, k_cache: torch.Tensor, block_size: int) -> None:
    if page_table.shape != plan_table.shape or page_table.dtype != torch.int32 or page_table.stride(-1) != 1:
        raise ValueError(
            f"page_table must be int32 {tuple(plan_table.shape)} with unit stride along blocks (the plan's shape), "
            f"got {page_table.dtype} {tuple(page_table.shape)}"
        )
    if k_cache.shape[0] % block_size:
        raise ValueError(f"cache slots ({k_cache.shape[0]}) must be whole pages of {block_size}")


def decode_attention(
    plan: DecodePlan,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    selected: torch.Tensor | None,
    out: torch.Tensor | None = None,
    sm_scale: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    page_table: torch.Tensor | None = None,
    requests: tuple[int, int] | None = None,
    dense: bool = False,
    chained: bool = False,
) -> torch.Tensor:
    """The attention half of :func:`run_decode`: sparse GQA over the blocks ``selected`` chose.

    ``page_table`` (default ``plan.page_table``): another int32 table of the plan's shape that
    maps every block to its page *of k_cache / v_cache* (sparse offload passes its block cache's
    entries, ``k_cache`` then being the cache pages as ``[entries * block, heads, dim]`` rows);
    only the blocks a request selected are read through it. ``requests = (first, last)``: attend
    requests ``first .. last - 1`` only (one launch over those tiles; their results are those of
    the whole batch, bit for bit). Returns ``out`` (allocated when None).

    ``dense`` (``selected`` None): a dense-attention layer over the same plan. M3's dense layers
    (the first three) share the batch's pages with its sparse layers, so each query token attends
    every block up to its position (a draft tree's token: the prefix, then its path among the
    drafts), split over ``plan.dense_splits`` programs and merged in the last. For a verify batch
    that reads the K/V once per (token, kv head) split, where an extend kernel without a split
    over the keys gives each (request, head) one program.

    ``chained``: the last launch on the stream was the top-k of ``decode_select(chained=True)``
    that wrote ``selected``; this launch then overlaps its end (:func:`run_decode`).
    """
    p = plan.params
    if chained and dense:
        raise ValueError("a dense decode attention reads no choice: it cannot be chained after a top-k")
    if dense:
        if selected is not None or requests is not None or page_table is not None:
            raise ValueError("dense attention reads every block of the plan's own table: no selected, requests or page_table")
        if q.dim() != 3 or q.shape[0] < plan.num_tokens or q.shape[1] % k_cache.shape[1]:
            raise ValueError(f"q must be [tokens>={plan.num_tokens}, q_heads (a multiple of kv heads), head_dim], got {tuple(q.shape)}")
        if k_cache.shape[1] != plan.num_kv_heads:
            raise ValueError(f"k_cache has {k_cache.shape[1]} kv heads, the plan was made for {plan.num_kv_heads}")
    elif selected is None:
        raise ValueError("sparse decode attention needs the blocks each token selected (selected), or dense=True")
    table = plan.page_table if page_table is None else page_table
    _check_page_table_like(plan.page_table, table, k_cache, p.block_size)
    _check_kv_scales(k_cache, v_cache, k_scale, v_scale)
    if out is None:
        out = torch.empty(plan.num_tokens, q.shape[1], v_cache.shape[-1], dtype=q.dtype, device=q.device)
    tiles = plan.tiles
    if requests is not None:
        first, last = requests
        if not 0 <= first < last <= tiles.count:
            raise ValueError(f"requests {requests} outside the plan's {tiles.count}")
        if plan.tree is not None:
            raise ValueError("a subset of a draft-tree verify batch: trees attend the whole batch")
        tiles = Tiles(req=tiles.req[first:last], tok0=tiles.tok0[first:last], pos0=tiles.pos0[first:last],
                      ntok=tiles.ntok[first:last], max_tokens=tiles.max_tokens)
    _attention(
        tiles, table, q, k_cache, v_cache, table if dense else selected, out,
        splits=plan.dense_splits if dense else plan.attn_splits, sm_scale=_scale(sm_scale, q.shape[-1]), block_size=p.block_size,
        tickets=plan.tickets, k_scale=k_scale, v_scale=v_scale, tree=plan.tree, per_token=True, dense=dense,
        chained=chained,
    )
    return out


def prefill_select(
    plan: PrefillPlan, iq: torch.Tensor, ik_cache: torch.Tensor, ik_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """Chosen blocks ``[tokens, kv_heads, topk]`` (int32, ascending, -1 padded) of an extend batch.

    Block-max index scores on tensor cores with a running top-k per row, so no score matrix is
    written. With ``plan.index_splits == 1`` one fused kernel scans every visible block of a tile;
    otherwise each tile's blocks are shared by ``index_splits`` programs that write per-row
    candidates, and a merge launch keeps their top-k (a short chunk after a long prefix).
    ``ik_scale`` as in :func:`decode_select`.
    """
    p = plan.params
    hkv, di = iq.shape[1], iq.shape[-1]
    ik2 = ik_cache.reshape(ik_cache.shape[0], di)
    _check_index_scale(ik2, ik_scale)
    itiles = plan.index_tiles
    selected = torch.empty(plan.num_tokens, hkv, p.topk, dtype=torch.int32, device=iq.device)
    index_rows = itiles.max_tokens * hkv
    kp = _pow2(p.topk)
    split = plan.index_splits > 1
    cand_shape = (itiles.count, plan.index_splits, index_rows, kp) if split else (1, 1, 1, 1)
    cand_val = torch.empty(cand_shape, dtype=torch.float32, device=iq.device)
    cand_id = torch.empty(cand_shape, dtype=torch.int32, device=iq.device)
    desc = _descriptor_loads_fit(ik2[:, None])
    ik_desc = TensorDescriptor.from_tensor(ik2, [p.block_size, di]) if desc else ik2
    warps, stages = _index_scan_launch(split, index_rows)
    prefill_index_topk_kernel[(itiles.count, plan.index_splits)](
        iq, ik2, ik_desc, ik2 if ik_scale is None else ik_scale, plan.page_table, selected, cand_val, cand_id,
        *_tile_args(itiles),
        iq.stride(0), iq.stride(1),
        ik2.stride(0),
        plan.page_table.stride(0),
        selected.stride(0), selected.stride(1),
        cand_val.stride(0), cand_val.stride(1),
        NUM_HEADS=hkv, ROWS=index_rows, D=di, BLOCK=p.block_size,
        TOPK=p.topk, KP=kp, LOCAL=p.local_blocks, INIT=p.init_blocks, SPLIT=split, KEY_FP8=ik_scale is not None,
        DESC=desc, num_warps=warps, num_stages=stages,
    )
    if split:
        prefill_index_merge_kernel[(itiles.count,)](
            cand_val, cand_id, selected,
            itiles.tok0, itiles.pos0, itiles.ntok,
            plan.index_splits,
            cand_val.stride(0), cand_val.stride(1),
            selected.stride(0), selected.stride(1),
            NUM_HEADS=hkv, ROWS=index_rows, TOPK=p.topk, KP=kp,
            num_warps=4,
        )
    return selected


def _index_scan_launch(split: bool, index_rows: int) -> tuple[int, int]:
    """``(warps, stages)`` of the prefill index scan. Split scans (a short chunk after a long prefix)
    run 4 warps and 3 stages, whole-tile scans of 128 rows 8 warps and 2 stages: on an H200, 4K new
    tokens after 124K took 1.09 ms against 1.19 with 8 warps, 128K new tokens 14.9 ms against 15.5
    with 4 (``benchmarks/prefill_index_variants.py``). 64-row tiles keep 4 warps and 3 stages."""
    if split or index_rows < 128:
        return 4, 3
    return 8, 2


def run_prefill(
    plan: PrefillPlan,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    iq: torch.Tensor,
    ik_cache: torch.Tensor,
    sm_scale: float | None = None,
    out: torch.Tensor | None = None,
    ik_scale: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sparse layer's extend step: fused index scan + top-k, then sparse attention.

    The attention is KV-block-major for long extends (per chunk of tokens: sort the selection's
    pairs by block, partial attention per block, log-sum-exp merge) and query-major for short
    ones, as the plan says (``plan.block_major``).

    Shapes as :func:`run_decode` with rows packed request after request; the new tokens' K, V and
    index keys must already be in the caches (SGLang writes them before attention runs).
    ``ik_scale``, ``k_scale`` and ``v_scale`` as in :func:`run_decode`.
    """
    p = plan.params
    _check_inputs(q, k_cache, v_cache, iq, ik_cache, plan.num_tokens, p.block_size)
    _check_kv_scales(k_cache, v_cache, k_scale, v_scale)
    selected = prefill_select(plan, iq, ik_cache, ik_scale)
    out = prefill_attention(plan, q, k_cache, v_cache, selected, out, sm_scale, k_scale, v_scale)
    return out, selected


def prefill_attention(
    plan: PrefillPlan,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    selected: torch.Tensor,
    out: torch.Tensor | None = None,
    sm_scale: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    page_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """The attention half of :func:`run_prefill` (block-major or query-major, as planned).

    ``page_table``: as in :func:`decode_attention` (sparse offload passes a staging buffer's page
    of every block, ``k_cache`` / ``v_cache`` being that buffer). Returns ``out``.
    """
    p = plan.params
    if page_table is not None:
        _check_page_table_like(plan.page_table, page_table, k_cache, p.block_size)
        plan = dataclasses.replace(plan, page_table=page_table)
    _check_kv_scales(k_cache, v_cache, k_scale, v_scale)
    if out is None:
        out = torch.empty(plan.num_tokens, q.shape[1], v_cache.shape[-1], dtype=q.dtype, device=q.device)
    scale = _scale(sm_scale, q.shape[-1])
    if plan.block_major:
        _attention_block_major(plan, q, k_cache, v_cache, selected, out, scale, p.block_size, k_scale, v_scale)
    elif plan.attn_tiles.max_tokens == 1 and _descriptor_loads_fit(k_cache, v_cache):
        _attention_one_token_tiles(plan.attn_tiles, plan.page_table, q, k_cache, v_cache, selected, out, scale,
                                   p.block_size, k_scale, v_scale)
    else:
        _attention(
            plan.attn_tiles, plan.page_table, q, k_cache, v_cache, selected, out, splits=1, sm_scale=scale,
            block_size=p.block_size, k_scale=k_scale, v_scale=v_scale,
        )
    return out


def _descriptor_loads_fit(*caches: torch.Tensor) -> bool:
    """Whether tensor descriptors can address the blocks of these ``[slots, heads, dim]`` caches
    (K and V, or the index keys): rows of ``heads * dim`` contiguous elements from a 16-byte
    aligned base, on a GPU with TMA (Hopper on) or under the Triton interpreter (CPU), which
    emulates them. On a GPU only 16-bit caches, the ones measured and tested there (fp8 caches are
    tested through it under the interpreter only)."""
    for cache in caches:
        if cache.is_cuda and (not _hopper_or_later(cache.device) or cache.dtype not in _DESCRIPTOR_GPU_DTYPES):
            return False
        heads, dim = cache.shape[1], cache.shape[2]
        if cache.stride() != (heads * dim, dim, 1) or cache.data_ptr() % 16:
            return False
    return True


@functools.cache
def _hopper_or_later(device: torch.device) -> bool:
    """Hopper or later: TMA and programmatic dependent launch (asked once per device: the check
    runs for every sparse layer's extend and decode)."""
    return torch.cuda.get_device_capability(device)[0] >= 9


def _attention_one_token_tiles(
    tiles: Tiles, page_table, q, k_cache, v_cache, selected, out, sm_scale: float, block_size: int,
    k_scale: float = 1.0, v_scale: float = 1.0, num_warps: int = 4, num_stages: int = 3,
) -> None:
    """Query-major attention of an extend batch's one-token tiles (``triton_prefill_attention``);
    the launch settings are the fastest measured (``benchmarks/msa_prefill_attention_variants.py``)."""
    hkv, d = k_cache.shape[1], q.shape[-1]
    group = q.shape[1] // hkv
    topk = selected.shape[-1]
    k_desc, v_desc = (
        TensorDescriptor.from_tensor(cache.view(cache.shape[0], hkv * d), [block_size, d]) for cache in (k_cache, v_cache)
    )
    prefill_attention_kernel[(tiles.count, hkv)](
        q, k_cache, v_cache, k_desc, v_desc, page_table, selected, out,
        tiles.req, tiles.tok0, tiles.pos0,
        *_attention_strides(q, k_cache, v_cache, page_table, selected, out),
        sm_scale * k_scale * _LOG2E, v_scale,
        G=group, ROWS=max(16, _pow2(group)), D=d, BLOCK=block_size, TOPK=topk, KP=_pow2(topk),
        num_warps=num_warps, num_stages=num_stages,
    )
