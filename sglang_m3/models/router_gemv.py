"""M3's MoE router logits for a few rows: a Triton GEMV over the 16-bit parts of the fp32 weight.

The router (:mod:`sglang_m3.models.moe_routing`) takes the fp32 logits ``[T, E]`` (E = 128) of
16-bit activations ``x [T, H]`` (H = 6,144) from the stacked 16-bit parts of its fp32 weight
(``gate_half``, ``[P * E, H]``, P = 1 for a bf16 checkpoint, up to 3). At the row counts of decode
(1 to 16 rows) ``torch.mm`` runs that as a cuBLAS split-K GEMM of two launches, about 13 us per
MoE layer and step on an H200 as one call per graph replay (``benchmarks/results/router_gemm_h200/``),
8.5 back to back, while the weight it
streams, 1.5 MB (one part) to 4.7 MB (three), takes 0.3 to 1 us at HBM bandwidth. (Upstream
SGLang has a "tiny N GEMM" kernel for the same shape.) This GEMV took 3.5 against 8.5 us at one
row and three parts, 3.2 against 6.8 at one part (graphs of 48 calls back to back, each call's
weight from HBM; :data:`MAX_GEMV_ROWS` has the other row counts), and its logits were closer to
a float64 reference than the GEMM's: 2.8e-7 against 3.8e-6 at one row, 4.2e-7 against 5.2e-6 at
eight (the fp32 linear's 3.0e-7 and 1.3e-6; measured with this kernel's first, 4-warp tiles).

One launch, one program per ``BLOCK_E`` experts (128 programs at M3's width: the weight streams
into as many SMs), each reading those experts' rows of every part once against all T rows of
``x``. Arithmetic, all in fp32: per weight element the parts are summed smallest first,
``p0 + (p1 + p2)``, which is exact for parts as ``moe_routing.split_into_16bit_parts`` makes them
(each partial sum from the smallest part up is one of the split's remainders, an fp32 value, and
the full sum is the weight). So a logit is ``sum_k x[t, k] * w[e, k]`` with ``w`` the fp32 router
weight itself: the fp32 linear's math, one FMA per term on CUDA (rather than one per part and
term, each rounded). Only the order of the sums differs from an SGEMM's, and it is fixed: a K step
of ``BLOCK_K`` columns is loaded as ``[GROUPS, VEC]`` (``VEC`` contiguous columns per thread, one
vector load); each thread sums its ``VEC`` products (no shuffles) into an accumulator per (row,
expert, group), the steps in K order, and one ``tl.sum`` over the groups at the end. No atomics,
no K split across programs: for one compiled tile (:func:`gemv_tile`, by the row count rounded up
to a power of two) the logits are bit-identical from run to run, so the router's top-k never
flips between runs. (A row's logits can differ in the last bits between row counts that take
different tiles.)

Each program loads the next K step (weights ``evict_first``: read once; ``x`` is read by every
program, from L2) before it multiplies the current one: Triton's pipeliner leaves loads that feed
no ``tl.dot`` in place, and at about one program per SM the bytes in flight set the bandwidth.
Nothing is read on the host, the grid depends on E alone and the output comes from
``torch.empty`` (every element written once): the call can be captured in a CUDA graph. Under the
Triton interpreter (CPU tests) the same kernel runs on CPU tensors; :func:`gemv_serves` routes only
CUDA tensors here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

#: Most rows the GEMV takes. Measured on an H200 (M3's width, each call's weight from HBM,
#: ``benchmarks/router_gemm.py --weight-copies 48``), three parts / one part against the GEMM over
#: the parts: 3.5 / 3.2 against 8.5 / 6.8 us at one row, 4.2 / 3.6 against 9.7 / 6.9 at four,
#: 6.6 / 6.1 against 9.8 / 6.9 at eight, but 13.8 against 9.8 at sixteen (three parts, the best of
#: the swept tiles): every program multiplies all T rows of ``x`` with its weight rows, so the
#: GEMV's time grows by 0.6 to 0.9 us a row past four, while cuBLAS's GEMM, which tiles the rows as
#: well, stays nearly flat (8.5 to 10.3 us from 1 to 64 rows, three parts). So decode steps and
#: short verifies (up to 8 rows) take the GEMV; larger batches the GEMM.
MAX_GEMV_ROWS = 8
#: Parts the kernel sums (``moe_routing.MAX_ROUTER_PARTS``).
MAX_PARTS = 3


@dataclass(frozen=True)
class GemvTile:
    """Tiles of one launch: ``block_e`` experts (weight rows of each part) per program, ``block_k``
    columns per K step, ``num_warps``, and ``vec`` contiguous columns per thread and load (8:
    16-byte loads; 4: 8-byte loads)."""

    block_e: int
    block_k: int
    num_warps: int = 8
    vec: int = 8


#: Tile by rows rounded up to a power of two (``T_PAD``): the fastest of eight candidates on an
#: H200 (three parts, each call's weight from HBM; one part within 0.3 us of its fastest). Up to
#: four rows: 2,048-column steps (three at M3's width), 16-byte loads, 8 warps: 3.5 us at one row
#: against 3.7 to 5.2 for the others (4 warps, 8-byte loads, 1,024- or 4,096-column steps); eight
#: rows: 1,024-column steps, 6.6 us against 7.1 to 9.2. An sm_90 compile (Triton 3.8) holds them in
#: 46 to 103 registers a thread (three parts), no spills.
GEMV_TILES: dict[int, GemvTile] = {
    1: GemvTile(block_e=1, block_k=2048, num_warps=8, vec=8),
    2: GemvTile(block_e=1, block_k=2048, num_warps=8, vec=8),
    4: GemvTile(block_e=1, block_k=2048, num_warps=8, vec=8),
    8: GemvTile(block_e=1, block_k=1024, num_warps=8, vec=8),
}


def padded_rows(rows: int) -> int:
    """``rows`` (1 to :data:`MAX_GEMV_ROWS`) rounded up to a power of two: the kernel's ``T_PAD``."""
    return triton.next_power_of_2(rows)


def gemv_tile(rows: int) -> GemvTile:
    return GEMV_TILES[padded_rows(rows)]


def gemv_serves(x: torch.Tensor) -> bool:
    """Whether :func:`router_logits_gemv` takes activations ``x [T, H]``: CUDA tensors of 1 to
    :data:`MAX_GEMV_ROWS` rows with unit stride along H (other inputs keep ``torch.mm``)."""
    return x.is_cuda and 1 <= x.shape[0] <= MAX_GEMV_ROWS and x.stride(-1) == 1


@triton.jit
def _load_tile(ptrs, mask, EVEN_K: tl.constexpr):
    if EVEN_K:
        tile = tl.load(ptrs, eviction_policy="evict_first")
    else:
        tile = tl.load(ptrs, mask=mask, other=0.0, eviction_policy="evict_first")
    return tile


@triton.jit
def _load_parts(ptrs, part_stride, mask, PARTS: tl.constexpr, EVEN_K: tl.constexpr):
    """The 16-bit tiles of parts 0, 1, 2 at ``ptrs`` (part 0), ``part_stride`` elements apart
    (part 0's tile stands in for parts beyond ``PARTS``, never read)."""
    w0 = _load_tile(ptrs, mask, EVEN_K)
    w1 = w0
    w2 = w0
    if PARTS > 1:
        w1 = _load_tile(ptrs + part_stride, mask, EVEN_K)
    if PARTS > 2:
        w2 = _load_tile(ptrs + 2 * part_stride, mask, EVEN_K)
    return w0, w1, w2


@triton.jit
def _tile_sums(x, w0, w1, w2, PARTS: tl.constexpr):
    """``[T_PAD, BLOCK_E, GROUPS]`` fp32 sums over each ``VEC`` columns of one K tile of ``x
    [T_PAD, 1, GROUPS, VEC]`` times the fp32 weight, its parts ``[1, BLOCK_E, GROUPS, VEC]``
    summed smallest first (exact: module docstring). Each group is one thread's vector (Triton's
    layout for the contiguous ``VEC`` axis), so these sums need no shuffles."""
    if PARTS == 1:
        w = w0.to(tl.float32)
    elif PARTS == 2:
        w = w0.to(tl.float32) + w1.to(tl.float32)
    else:
        w = w0.to(tl.float32) + (w1.to(tl.float32) + w2.to(tl.float32))
    return tl.sum(x.to(tl.float32) * w, axis=3)


@triton.jit
def router_gemv_kernel(
    x_ptr, w_ptr, out_ptr,
    T, H, E, part_stride, stride_xt, stride_we, stride_ot,
    PARTS: tl.constexpr, T_PAD: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """``out[t, e] = sum_k x[t, k] * (sum_p w[p * E + e, k])`` for experts
    ``[program_id(0) * BLOCK_E, ...)`` and all ``T`` rows (``T <= T_PAD``)."""
    GROUPS: tl.constexpr = BLOCK_K // VEC
    experts = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    rows = tl.arange(0, T_PAD)
    cols = tl.arange(0, GROUPS)[:, None] * VEC + tl.arange(0, VEC)[None, :]  # [GROUPS, VEC]
    # a partial expert block re-reads its last expert, padding rows the last row (neither stored)
    w_rows = tl.minimum(experts, E - 1).to(tl.int64)
    x_rows = tl.minimum(rows, T - 1).to(tl.int64)
    w_ptrs = w_ptr + w_rows[None, :, None, None] * stride_we + cols[None, None, :, :]  # [1, BLOCK_E, GROUPS, VEC]
    x_ptrs = x_ptr + x_rows[:, None, None, None] * stride_xt + cols[None, None, :, :]  # [T_PAD, 1, GROUPS, VEC]
    in_k = cols[None, None, :, :] < H
    w0, w1, w2 = _load_parts(w_ptrs, part_stride, in_k, PARTS, EVEN_K)
    if EVEN_K:
        x = tl.load(x_ptrs)
    else:
        x = tl.load(x_ptrs, mask=in_k, other=0.0)
    acc = tl.zeros((T_PAD, BLOCK_E, GROUPS), dtype=tl.float32)
    for k0 in range(BLOCK_K, H, BLOCK_K):
        in_k = cols[None, None, :, :] < H - k0
        n0, n1, n2 = _load_parts(w_ptrs + k0, part_stride, in_k, PARTS, EVEN_K)
        if EVEN_K:
            next_x = tl.load(x_ptrs + k0)
        else:
            next_x = tl.load(x_ptrs + k0, mask=in_k, other=0.0)
        acc += _tile_sums(x, w0, w1, w2, PARTS)
        w0, w1, w2, x = n0, n1, n2, next_x
    acc += _tile_sums(x, w0, w1, w2, PARTS)
    out = tl.sum(acc, axis=2)  # [T_PAD, BLOCK_E]
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_ot + experts[None, :]
    tl.store(out_ptrs, out, mask=(rows < T)[:, None] & (experts < E)[None, :])


def router_logits_gemv(x: torch.Tensor, parts: torch.Tensor, experts: int, tile: GemvTile | None = None) -> torch.Tensor:
    """Router logits ``[T, E]`` fp32 of ``x [T, H]`` (bf16 or fp16, 1 to :data:`MAX_GEMV_ROWS`
    rows, unit stride along H) and the weight's stacked 16-bit parts ``parts [P * E, H]`` (``x``'s
    dtype, P up to :data:`MAX_PARTS`, contiguous rows), in one launch. ``tile`` overrides
    :func:`gemv_tile` (the benchmark's sweep)."""
    if x.dim() != 2 or parts.dim() != 2:
        raise ValueError(f"x must be [rows, hidden] and parts [parts * experts, hidden], got {tuple(x.shape)}, {tuple(parts.shape)}")
    rows, hidden = x.shape
    if x.dtype not in (torch.bfloat16, torch.float16) or parts.dtype != x.dtype:
        raise ValueError(f"x and parts must share a 16-bit dtype, got {x.dtype} and {parts.dtype}")
    if parts.shape[1] != hidden or experts < 1 or parts.shape[0] % experts or not 1 <= parts.shape[0] // experts <= MAX_PARTS:
        raise ValueError(f"parts must be [P * {experts}, {hidden}] with P in 1..{MAX_PARTS}, got {tuple(parts.shape)}")
    if not 1 <= rows <= MAX_GEMV_ROWS:
        raise ValueError(f"x must have 1 to {MAX_GEMV_ROWS} rows, got {rows}")
    if x.stride(1) != 1 or parts.stride(1) != 1:
        raise ValueError(f"x and parts need unit stride along hidden, got strides {x.stride()}, {parts.stride()}")
    out = torch.empty((rows, experts), dtype=torch.float32, device=x.device)
    tile = tile or gemv_tile(rows)
    router_gemv_kernel[(triton.cdiv(experts, tile.block_e),)](
        x, parts, out,
        rows, hidden, experts, experts * parts.stride(0), x.stride(0), parts.stride(0), out.stride(0),
        PARTS=parts.shape[0] // experts, T_PAD=padded_rows(rows), BLOCK_E=tile.block_e, BLOCK_K=tile.block_k,
        VEC=tile.vec, EVEN_K=hidden % tile.block_k == 0, num_warps=tile.num_warps,
    )
    return out
