"""MoE experts with MXFP8 weights and bf16 activations (W8A16) in Triton, for Hopper; fp32
activations (W8A32) for fp32 models.

Hopper has no MX-scaled FP8 GEMM (that is Blackwell's ``tcgen05``), but decode is bound by
reading the expert weights, not by FLOPs: keeping them as e4m3 (1 byte) plus one e8m0 byte per 32
elements halves what each step reads against BF16.

Weights are the checkpoint's layout, stacked per expert: ``w13 [E, 2I, H]`` (rows ``[0, I)`` the
gate ``w1``, ``[I, 2I)`` the up ``w3``), ``w2 [E, H, I]``, each with uint8 scales
``[E, rows, K/32]``; scale byte ``b`` means ``2 ** (b - 127)`` for 32 consecutive elements along
K (byte 0 means 0.0), as ``sglang_m3/quant/mxfp8.py`` and SGLang decode it.

One call (:func:`mxfp8_fused_experts`) on a GEMM path is four launches (five on the fp16 path),
none of which reads anything on the host, with grids fixed by the token count, so it can be
captured in a CUDA graph (the GEMV path, below, is two such launches):

1. :func:`align_tokens`: the ``T * top_k`` (token, slot) pairs sorted by expert (stable) into
   ``BLOCK_M``-row blocks, each block one expert's (padding rows hold the sentinel ``T * top_k``),
   plus the expert of each block (-1 for the unused blocks at the end). The number of blocks is
   the static bound ``ceil((T*k + min(T*k, E) * (BLOCK_M - 1)) / BLOCK_M)``. One program, two
   passes over the pairs in chunks (counts, then placement); stable, so results are deterministic.
   On the fp16 path the same launch has one more program per token, which writes the token's
   row prescaled to fp16 (``mxfp8_gemm.prescale_row``).
2. gate/up GEMM with the activation in its epilogue: each program owns ``BLOCK_N`` intermediate
   columns of one block, accumulates the gate and the up rows side by side and stores
   ``act(gate, up)`` by block row (in the activations' dtype; fp32 on the fp16 path, whose next
   launch prescales each activation row to fp16 as step 1 did the tokens:
   ``mxfp8_gemm.prescale_rows``).
3. down GEMM: block rows of the activation times ``w2``, times each pair's routed weight, stored
   per (token, slot) in the activations' dtype.
4. the sum over the top-k slots per token in fp32, rounded once to the activations' dtype.

The experts run one of four ways (:data:`PATHS`), chosen by the token count (:func:`gemm_path`;
fp32 activations below):

- ``gemv`` (decode batches up to :data:`GEMV_MAX_TOKENS` tokens): ``mxfp8_gemv``'s two kernels
  instead of steps 1-4, no alignment and no ``tl.dot``: one program per (token, slot) pair streams
  its expert's gate and up rows against the token's row, one program per token streams the down
  rows of all its top-k experts and sums them in registers. At a few tokens the MMA paths pad the
  tokens to a 16-row tile and stage every weight tile for the dot, while the bytes are all that
  should count (``mxfp8_gemv``'s docstring has the per-element budget).
- ``fp16`` and ``bf16`` (decode and short prefill chunks, up to :data:`CORE_PATH_MAX_TOKENS`
  tokens): the shared core of ``mxfp8_gemm`` (32-column groups, the group scales applied to the
  fp32 partial sums, ``mma.sync``), with fp16 dots (e4m3 -> fp16 in one conversion per two
  elements; both GEMMs' activation rows prescaled by a power of two, the activation's prescale
  its own launch) or bf16 dots (the activations as they are; one more conversion instruction per
  weight element, one launch fewer). :data:`CORE_DOT` picks the served one.
- ``widen`` (long prefill chunks): each weight tile widened in registers to bf16 with its group
  scales (in fp32, exact) and bf16 dots; its per-element widening costs about 9 instructions per
  element and lane, which a 64-128-token tile amortizes but a decode tile does not.

All put the weights on the MMA's M side and the (few) tokens on N ("swap AB"), so a decode block
of 16 rows does not pad the weight-side tile, and all accumulate in fp32. Under the Triton
interpreter, which mis-evaluates bf16 arithmetic, bf16 dots run in fp32 (every operand is exact in
fp32 as well). Expert parallelism:
``first_expert`` maps global expert ids onto the local stack; pairs routed to experts outside it
contribute nothing (their rank's sum is zero there).

fp32 activations (an fp32 model, W8A32) run the same kernels with every intermediate (the
activation, each slot's output) and the result in fp32, and fp32 dots in IEEE precision
(``mxfp8_gemm.exact_dot``; the GEMV converts e4m3 to fp32 on the FMA pipe anyway), so the result is
the fp32 computation of the dequantized experts up to summation order: e4m3 -> fp32 is exact and
the e8m0 factors are powers of two. They never take the ``fp16`` path, whose prescale rounds
activation rows to fp16: the core serves them on the ``bf16`` path, whose dots take the
activations in their own dtype (:func:`gemm_path`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from msa_kernels.mxfp8_gemm import (
    GROUP, PRESCALE_BLOCK, exact_dot, mx_gemm_rows, prescale_row, prescale_rows, scale_words, unscale,
)
from msa_kernels.mxfp8_gemv import MOE_GEMV_TABLE, MoeGemvConfig, moe_gemv
from msa_kernels.mxfp8_gemv import expert_activation as _activation
from msa_kernels.triton_cast import round_cast

WEIGHT_DTYPE = torch.float8_e4m3fn
SCALE_DTYPE = torch.uint8
#: activation dtypes: bf16 (W8A16) and fp32 (W8A32, fp32 models)
ACT_DTYPES = (torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class TileConfig:
    """Tiles of both GEMMs: ``block_m`` token rows per expert block (the alignment's unit),
    ``block_n`` output columns (widen path: the gate/up tile holds their ``2 * block_n`` gate and
    up rows; core paths: ``block_n`` weight rows in both GEMMs, the gate/up tile taking
    ``block_n / 2`` intermediate columns), ``block_k`` along the reduction (a multiple of 32)."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 3


#: Tiles of the widen path: (largest token count, config), first match wins. Decode kept 16-row
#: blocks (most experts get one or two tokens) and narrow weight tiles for enough programs to
#: stream HBM; prefill takes 128-row blocks, whose weight tiles are reused across a block's tokens.
#: The first and last rows are the winners of ``benchmarks/mxfp8_moe.py --sweep`` on the H100
#: (commit 1829e27: T=1 126 us, T=16 1.19 ms, T=64 2.67 ms with 32-wide tiles; T=8192 15.4 ms with
#: 128x64x64, 4 warps); the middle row is not measured.
TILE_TABLE: tuple[tuple[int, TileConfig], ...] = (
    (64, TileConfig(block_m=16, block_n=32, block_k=128, num_warps=4, num_stages=4)),
    (512, TileConfig(block_m=32, block_n=64, block_k=128, group_m=4, num_warps=4, num_stages=3)),
    (1 << 62, TileConfig(block_m=128, block_n=64, block_k=64, group_m=8, num_warps=4, num_stages=3)),
)
#: Tiles of the core paths (``block_k`` is one K step: 256 = eight scale groups read as one int64
#: word per row, 128 where K is not a multiple of 256). Measured on the H100 at 27f1706 (fp16 dots,
#: 64-row wgmma tiles, 4 warps, 128-column steps): T=1 166 us against the widen path's 126 us, although
#: its K loop compiles to 3.7 instructions per weight element and lane against 9: each 32-column
#: group's wgmma is waited for before its partial sums are scaled, which serializes a warpgroup.
#: Two warps per program cannot form a warpgroup, so Triton emits ``mma.sync``, which has no such
#: wait: 32 weight rows per program, 2.9 instructions per element and lane (sm_90 compile, Triton
#: 3.8). At one token: 4 blocks x 192 programs per GEMM, about 6 per SM (32 KB of shared memory at
#: 3 stages, 77 registers per thread each), all resident at once; bf16 dots 4.7 instructions.
#: Not timed yet: ``benchmarks/mxfp8_moe.py --sweep`` times these against the alternatives.
CORE_TILE_TABLE: tuple[tuple[int, TileConfig], ...] = (
    (64, TileConfig(block_m=16, block_n=32, block_k=256, num_warps=2, num_stages=3)),
    (1 << 62, TileConfig(block_m=32, block_n=32, block_k=128, group_m=4, num_warps=2, num_stages=3)),
)
TABLES = {"fp16": CORE_TILE_TABLE, "bf16": CORE_TILE_TABLE, "widen": TILE_TABLE}
PATHS = ("gemv", *TABLES)
#: Largest token count the GEMV path serves (module docstring): there each pair's expert rows are
#: streamed once per token, which pays while few tokens share an expert. Measured on the H100 at
#: 4b5f448 (``benchmarks/mxfp8_moe.py``, M3's TP1 experts): GEMV 97.9 / 175.9 / 325.2 / 594.8 /
#: 1093.8 us at 1 / 2 / 4 / 8 / 16 tokens against the fp16 core's 118.6 / 211.7 / 383.8 / 660.2 /
#: 1157.5; at 64 tokens the core wins (2571 vs 3958).
GEMV_MAX_TOKENS = 16
#: Largest token count a core path serves: up to here the weights are read about once per expert
#: and the step is bound by those bytes, where the core's lighter instruction stream matters;
#: beyond it the widen path's larger token tiles reuse each weight tile more. Measured on the
#: H100 (``benchmarks/mxfp8_moe.py`` at 03d147c, us for fp16 core / bf16 core / widen): T=1
#: 118.5 / 124.1 / 127.3, T=16 1158 / 1166 / 1199, T=64 2570 / 2571 / 2727, T=512 4270 / 4282 /
#: 3759. The crossover lies between 64 and 512 tokens and was not located; 64 is the last count
#: where the core measured faster.
CORE_PATH_MAX_TOKENS = 64
#: the core path served up to CORE_PATH_MAX_TOKENS: "fp16" (fewer instructions per weight
#: element) or "bf16" (one launch fewer); fp16 measured faster at 1, 16 and 64 tokens (above)
CORE_DOT = "fp16"


def gemm_path(tokens: int, dtype: torch.dtype = torch.bfloat16) -> str:
    """The path (:data:`PATHS`) :func:`mxfp8_fused_experts` takes for ``tokens`` rows of ``dtype``
    (module docstring): the core's ``CORE_DOT`` for bf16, ``bf16`` (dots in the activations' own
    dtype) for fp32, which the fp16 prescale would round."""
    if tokens <= GEMV_MAX_TOKENS:
        return "gemv"
    if tokens > CORE_PATH_MAX_TOKENS:
        return "widen"
    return "bf16" if dtype == torch.float32 else CORE_DOT


def pick_config(tokens: int, path: str = "widen") -> TileConfig | MoeGemvConfig:
    """The tile config of ``path`` for a batch of ``tokens`` rows (:data:`TABLES`; the GEMV path's
    :data:`~msa_kernels.mxfp8_gemv.MOE_GEMV_TABLE`, before ``mxfp8_gemv.moe_config`` narrows its
    gate/up tile for narrow intermediate slices)."""
    table = MOE_GEMV_TABLE if path == "gemv" else TABLES[path]
    return next(config for bound, config in table if tokens <= bound)


# ---------------------------------------------------------------------------------------------
# 1. token -> expert alignment
# ---------------------------------------------------------------------------------------------


@triton.jit
def _local_experts(ids_ptr, slots, n_slots, first_expert, num_experts):
    """Local expert of each pair in ``slots`` (-1 where out of range or not held here)."""
    local = tl.load(ids_ptr + slots, mask=slots < n_slots, other=-1).to(tl.int32) - first_expert
    held = (slots < n_slots) & (local >= 0) & (local < num_experts)
    return tl.where(held, local, -1)


@triton.jit
def align_kernel(
    ids_ptr, sorted_ptr, block_expert_ptr, n_slots, first_expert, num_experts, num_blocks,
    x_ptr, x16_ptr, shift_ptr, hidden, stride_x, stride_x16,
    BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, E_POW2: tl.constexpr, PRESCALE: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Program 0 aligns the pairs (:func:`_align_pairs`); with ``PRESCALE`` (the fp16 path) programs
    ``1 + t`` write token ``t``'s prescaled fp16 row (``mxfp8_gemm.prescale_row``)."""
    pid = tl.program_id(0)
    if PRESCALE and pid > 0:
        prescale_row(x_ptr, x16_ptr, shift_ptr, pid - 1, hidden, stride_x, stride_x16, BLOCK_H)
    else:
        _align_pairs(ids_ptr, sorted_ptr, block_expert_ptr, n_slots, first_expert, num_experts, num_blocks, BLOCK_M, CHUNK, E_POW2)


@triton.jit
def _align_pairs(
    ids_ptr, sorted_ptr, block_expert_ptr, n_slots, first_expert, num_experts, num_blocks,
    BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, E_POW2: tl.constexpr,
):
    """Pass 1 counts pairs per expert; expert ``e`` then owns rows
    ``[start_e, start_e + ceil(count_e / BLOCK_M) * BLOCK_M)``. Pass 2 writes each pair's slot
    id at ``start_e`` + (pairs of ``e`` before it), after the sentinel fill of every row."""
    experts = tl.arange(0, E_POW2)
    lanes = tl.arange(0, CHUNK)
    counts = tl.zeros([E_POW2], dtype=tl.int32)
    for first in range(0, n_slots, CHUNK):
        local = _local_experts(ids_ptr, first + lanes, n_slots, first_expert, num_experts)
        counts += tl.sum((local[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    # Block b belongs to the number of experts whose rows end at or before it.
    end_blocks = tl.where(experts < num_experts, ends // BLOCK_M, 0x3FFFFFFF)
    for first in range(0, num_blocks, CHUNK):
        blocks = first + lanes
        owner = tl.sum((end_blocks[None, :] <= blocks[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + blocks, tl.where(owner < num_experts, owner, -1), mask=blocks < num_blocks)
    for first in range(0, num_blocks * BLOCK_M, CHUNK):
        rows = first + lanes
        tl.store(sorted_ptr + rows, tl.full([CHUNK], 0, tl.int32) + n_slots, mask=rows < num_blocks * BLOCK_M)
    tl.debug_barrier()  # the fill above and the placement below may touch the same rows
    placed = tl.zeros([E_POW2], dtype=tl.int32)
    for first in range(0, n_slots, CHUNK):
        slots = first + lanes
        local = _local_experts(ids_ptr, slots, n_slots, first_expert, num_experts)
        one_hot = local[:, None] == experts[None, :]
        base = tl.sum(tl.where(one_hot, (starts + placed)[None, :], 0), axis=1)
        earlier = (local[:, None] == local[None, :]) & (lanes[None, :] < lanes[:, None])
        rank = tl.sum(earlier.to(tl.int32), axis=1)
        tl.store(sorted_ptr + base + rank, slots, mask=local >= 0)
        placed += tl.sum(one_hot.to(tl.int32), axis=0)


def num_blocks_bound(n_slots: int, num_experts: int, block_m: int) -> int:
    """Blocks any routing of ``n_slots`` pairs over ``num_experts`` experts needs at most."""
    return triton.cdiv(n_slots + min(n_slots, num_experts) * (block_m - 1), block_m)


def align_tokens(
    topk_ids: torch.Tensor, num_experts: int, block_m: int, first_expert: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sorted_slots [blocks * block_m] int32, block_expert [blocks] int32)`` for ``topk_ids
    [T, k]`` (global ids; local expert = id - ``first_expert``). Pair ``s`` is token ``s // k``'s
    slot ``s % k``; padding rows hold ``T * k``; unused blocks have expert -1."""
    sorted_slots, block_expert, _ = align_and_prescale(topk_ids, num_experts, block_m, first_expert, None)
    return sorted_slots, block_expert


def align_and_prescale(
    topk_ids: torch.Tensor, num_experts: int, block_m: int, first_expert: int, x: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """:func:`align_tokens`' two tensors, and with ``x [T, H]`` also ``(x16 [T, H] fp16, shifts [T]
    int32)`` from ``mxfp8_gemm.prescale_row`` (the fp16 path's operand), all in one launch."""
    if topk_ids.dim() != 2 or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be [tokens, top_k] int32/int64, got {tuple(topk_ids.shape)} {topk_ids.dtype}")
    ids = topk_ids.contiguous()
    n_slots = ids.numel()
    blocks = num_blocks_bound(n_slots, num_experts, block_m)
    sorted_slots = torch.empty(blocks * block_m, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=ids.device)
    prescaled = None
    if x is not None:
        prescaled = (torch.empty(x.shape, dtype=torch.float16, device=x.device), torch.empty(x.shape[0], dtype=torch.int32, device=x.device))
    if n_slots == 0:
        return sorted_slots, block_expert, prescaled
    e_pow2 = max(16, triton.next_power_of_2(num_experts))
    chunk = 64 if e_pow2 <= 128 else 32
    rows = (x, *prescaled, x.shape[1], x.stride(0), prescaled[0].stride(0)) if x is not None else (None, None, None, 0, 0, 0)
    align_kernel[(1 + (x.shape[0] if x is not None else 0),)](
        ids, sorted_slots, block_expert, n_slots, first_expert, num_experts, blocks, *rows,
        BLOCK_M=block_m, CHUNK=chunk, E_POW2=e_pow2, PRESCALE=x is not None, BLOCK_H=PRESCALE_BLOCK, num_warps=8 if n_slots > 4096 else 4,
    )
    return sorted_slots, block_expert, prescaled


# ---------------------------------------------------------------------------------------------
# 2./3. the expert GEMMs
# ---------------------------------------------------------------------------------------------


@triton.jit
def _tile(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """(block, column tile) of program ``pid``, ``GROUP_M`` blocks per column sweep (L2 reuse)."""
    per_group = GROUP_M * num_n
    group_first = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_m - group_first, GROUP_M)
    return group_first + (pid % per_group) % group_rows, (pid % per_group) // group_rows


@triton.jit
def _block_rows(sorted_ptr, pid_m, n_slots, BLOCK_M: tl.constexpr):
    """Block ``pid_m``'s rows, the (token, slot) pair of each and which of them are pairs (the
    others are padding)."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(sorted_ptr + rows)
    return rows, slots, slots < n_slots


@triton.jit
def _scale_bytes(s_ptr, rows, row_ok, k0, K, stride_sn, BLOCK_K: tl.constexpr):
    """Rows ``rows``' e8m0 scale bytes ``[BLOCK_N, BLOCK_K / 32]`` for columns ``[k0, k0 + BLOCK_K)``
    (byte 0, meaning 0.0, past K). Left undecoded: the loop uses them one step later (prefetch)."""
    groups = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    s_ptrs = s_ptr + rows[:, None].to(tl.int64) * stride_sn + groups[None, :]
    return tl.load(s_ptrs, mask=row_ok[:, None] & (groups[None, :] < K // 32), other=0)


@triton.jit
def _weight_tile(w_ptr, scales, rows, row_ok, k0, K, stride_wn,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Rows ``rows`` x columns ``[k0, k0 + BLOCK_K)`` of one expert's e4m3 weight times their
    ``scales`` (:func:`_scale_bytes`), ``[BLOCK_N, BLOCK_K]`` in ``DOT_DTYPE``."""
    ks = k0 + tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows[:, None].to(tl.int64) * stride_wn + ks[None, :]
    if EVEN_K:
        w = tl.load(w_ptrs, mask=row_ok[:, None], other=0.0)
    else:
        w = tl.load(w_ptrs, mask=row_ok[:, None] & (ks[None, :] < K), other=0.0)
    factors = (scales.to(tl.int32) << 23).to(tl.float32, bitcast=True)  # byte b -> 2**(b-127), 0 -> 0.0
    w = tl.reshape(w.to(tl.float32), (BLOCK_N, BLOCK_K // 32, 32)) * factors[:, :, None]
    return tl.reshape(w, (BLOCK_N, BLOCK_K)).to(DOT_DTYPE)


@triton.jit
def gate_up_kernel(
    x_ptr, w_ptr, s_ptr, act_ptr, sorted_ptr, block_expert_ptr,
    n_slots, num_blocks, inter, K, alpha, limit,
    stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_am,
    TOP_K: tl.constexpr, SWIGLU_OAI: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """``act[r, c] = act(x[tok] . gate[e, c], x[tok] . up[e, c])`` for the rows ``r`` of one block
    and ``BLOCK_N`` intermediate columns ``c`` (``gate = w13[e, :inter]``, ``up = w13[e, inter:]``)."""
    pid_m, pid_n = _tile(tl.program_id(0), num_blocks, tl.cdiv(inter, BLOCK_N), GROUP_M)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    rows, slots, live = _block_rows(sorted_ptr, pid_m, n_slots, BLOCK_M)
    tokens = (slots // TOP_K).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    w_ptr += expert.to(tl.int64) * stride_we
    s_ptr += expert.to(tl.int64) * stride_se
    gate = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    gate_scales = _scale_bytes(s_ptr, cols, col_ok, 0, K, stride_sn, BLOCK_K)
    up_scales = _scale_bytes(s_ptr, cols + inter, col_ok, 0, K, stride_sn, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        # The next tile's scales load now, overlapping this tile's work: Triton's pipeliner leaves
        # loads under 4 bytes per thread (a scale tile) in place, where each would stall its step.
        next_gate = _scale_bytes(s_ptr, cols, col_ok, k0 + BLOCK_K, K, stride_sn, BLOCK_K)
        next_up = _scale_bytes(s_ptr, cols + inter, col_ok, k0 + BLOCK_K, K, stride_sn, BLOCK_K)
        ks = k0 + tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + tokens[:, None] * stride_xm + ks[None, :]
        if EVEN_K:
            x = tl.load(x_ptrs, mask=live[:, None], other=0.0)
        else:
            x = tl.load(x_ptrs, mask=live[:, None] & (ks[None, :] < K), other=0.0)
        xt = tl.trans(x.to(DOT_DTYPE))
        w_gate = _weight_tile(w_ptr, gate_scales, cols, col_ok, k0, K, stride_wn, BLOCK_N, BLOCK_K, EVEN_K, DOT_DTYPE)
        gate = exact_dot(w_gate, xt, gate)
        w_up = _weight_tile(w_ptr, up_scales, cols + inter, col_ok, k0, K, stride_wn, BLOCK_N, BLOCK_K, EVEN_K, DOT_DTYPE)
        up = exact_dot(w_up, xt, up)
        gate_scales, up_scales = next_gate, next_up
    out = _activation(gate, up, alpha, limit, SWIGLU_OAI)
    a_ptrs = act_ptr + rows[None, :].to(tl.int64) * stride_am + cols[:, None]
    tl.store(a_ptrs, round_cast(out, act_ptr.dtype.element_ty), mask=col_ok[:, None])


@triton.jit
def down_kernel(
    a_ptr, w_ptr, s_ptr, y_ptr, weights_ptr, sorted_ptr, block_expert_ptr,
    n_slots, num_blocks, hidden, K,
    stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """``y[slot, c] = weight[slot] * (act[r] . w2[e, c])`` for the live rows ``r`` of one block and
    ``BLOCK_N`` hidden columns ``c``."""
    pid_m, pid_n = _tile(tl.program_id(0), num_blocks, tl.cdiv(hidden, BLOCK_N), GROUP_M)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    rows, slots, live = _block_rows(sorted_ptr, pid_m, n_slots, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    w_ptr += expert.to(tl.int64) * stride_we
    s_ptr += expert.to(tl.int64) * stride_se
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    scales = _scale_bytes(s_ptr, cols, col_ok, 0, K, stride_sn, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        next_scales = _scale_bytes(s_ptr, cols, col_ok, k0 + BLOCK_K, K, stride_sn, BLOCK_K)  # see gate_up_kernel
        ks = k0 + tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + rows[:, None].to(tl.int64) * stride_am + ks[None, :]
        if EVEN_K:
            a = tl.load(a_ptrs)
        else:
            a = tl.load(a_ptrs, mask=ks[None, :] < K, other=0.0)
        w = _weight_tile(w_ptr, scales, cols, col_ok, k0, K, stride_wn, BLOCK_N, BLOCK_K, EVEN_K, DOT_DTYPE)
        acc = exact_dot(w, tl.trans(a.to(DOT_DTYPE)), acc)
        scales = next_scales
    acc *= tl.load(weights_ptr + slots, mask=live, other=0.0)[None, :]
    y_ptrs = y_ptr + slots[None, :].to(tl.int64) * stride_ym + cols[:, None]
    tl.store(y_ptrs, round_cast(acc, y_ptr.dtype.element_ty), mask=live[None, :] & col_ok[:, None])



@triton.jit
def gate_up_core_kernel(
    x_ptr, shift_ptr, w_ptr, words_ptr, act_ptr, sorted_ptr, block_expert_ptr,
    n_slots, num_blocks, inter, K, alpha, limit,
    stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_am,
    TOP_K: tl.constexpr, SWIGLU_OAI: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, GROUP_M: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    """:func:`gate_up_kernel` on a core path: one tile of ``BLOCK_N`` weight rows, the gate rows of
    ``BLOCK_N / 2`` intermediate columns then their up rows, against the block's token rows
    (``mxfp8_gemm.mx_gemm_rows``; fp16 dots read the prescaled rows and undo ``shift``); the
    activation is stored in ``act``'s dtype. One tile rather than a gate and an up tile: a K step
    then reads twice the bytes per loop iteration."""
    HALF: tl.constexpr = BLOCK_N // 2
    pid_m, pid_n = _tile(tl.program_id(0), num_blocks, tl.cdiv(inter, HALF), GROUP_M)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    rows, slots, live = _block_rows(sorted_ptr, pid_m, n_slots, BLOCK_M)
    tokens = slots // TOP_K
    tile_rows = tl.arange(0, BLOCK_N)
    cols = pid_n * HALF + tile_rows % HALF
    acc = mx_gemm_rows(
        w_ptr + expert * stride_we, words_ptr + expert * stride_se, cols + (tile_rows // HALF) * inter, cols < inter,
        stride_wn, stride_sn, x_ptr, tokens, live, stride_xm, K, BLOCK_N, BLOCK_M, GROUPS, DOT_DTYPE,
    )
    if DOT_DTYPE == tl.float16:
        acc *= unscale(tl.load(shift_ptr + tokens, mask=live, other=0))[None, :]
    gate, up = tl.split(tl.permute(tl.reshape(acc, (2, HALF, BLOCK_M)), (1, 2, 0)))
    out = _activation(gate, up, alpha, limit, SWIGLU_OAI)
    cols = pid_n * HALF + tl.arange(0, HALF)
    a_ptrs = act_ptr + rows[None, :].to(tl.int64) * stride_am + cols[:, None]
    tl.store(a_ptrs, round_cast(out, act_ptr.dtype.element_ty), mask=(cols < inter)[:, None])


@triton.jit
def down_core_kernel(
    a_ptr, shift_ptr, w_ptr, words_ptr, y_ptr, weights_ptr, sorted_ptr, block_expert_ptr,
    n_slots, num_blocks, hidden, K,
    stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, GROUP_M: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    """:func:`down_kernel` on a core path: the activation rows of one block (prescaled, for fp16
    dots) times ``w2`` (``mxfp8_gemm.mx_gemm_rows``), times each pair's routed weight."""
    pid_m, pid_n = _tile(tl.program_id(0), num_blocks, tl.cdiv(hidden, BLOCK_N), GROUP_M)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    rows, slots, live = _block_rows(sorted_ptr, pid_m, n_slots, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    acc = mx_gemm_rows(
        w_ptr + expert * stride_we, words_ptr + expert * stride_se, cols, col_ok, stride_wn, stride_sn,
        a_ptr, rows, live, stride_am, K, BLOCK_N, BLOCK_M, GROUPS, DOT_DTYPE,
    )
    if DOT_DTYPE == tl.float16:
        acc *= unscale(tl.load(shift_ptr + rows))[None, :]
    acc *= tl.load(weights_ptr + slots, mask=live, other=0.0)[None, :]
    y_ptrs = y_ptr + slots[None, :].to(tl.int64) * stride_ym + cols[:, None]
    tl.store(y_ptrs, round_cast(acc, y_ptr.dtype.element_ty), mask=live[None, :] & col_ok[:, None])


# ---------------------------------------------------------------------------------------------
# 4. sum over the top-k slots
# ---------------------------------------------------------------------------------------------


@triton.jit
def sum_slots_kernel(
    y_ptr, ids_ptr, out_ptr, hidden, first_expert, num_experts,
    TOP_K: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """``out[t] = sum_j y[t * TOP_K + j]`` over the slots routed to a held expert (others were never written)."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < hidden
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        slot = token * TOP_K + j
        local = tl.load(ids_ptr + slot).to(tl.int32) - first_expert
        held = (local >= 0) & (local < num_experts)
        acc += tl.load(y_ptr + slot * hidden + cols, mask=col_ok & held, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * hidden + cols, round_cast(acc, out_ptr.dtype.element_ty), mask=col_ok)


# ---------------------------------------------------------------------------------------------
# the whole layer
# ---------------------------------------------------------------------------------------------


def _check_weight(name: str, w: torch.Tensor, scale_name: str, scale: torch.Tensor, shape: tuple[int, ...]) -> None:
    if w.dtype != WEIGHT_DTYPE or tuple(w.shape) != shape:
        raise ValueError(f"{name} must be {WEIGHT_DTYPE} {shape}, got {w.dtype} {tuple(w.shape)}")
    scale_shape = (*shape[:-1], shape[-1] // GROUP)
    if scale.dtype != SCALE_DTYPE or tuple(scale.shape) != scale_shape:
        raise ValueError(f"{scale_name} must be uint8 (e8m0) {scale_shape}, got {scale.dtype} {tuple(scale.shape)}")
    for tensor, tensor_name in ((w, name), (scale, scale_name)):
        if tensor.stride(-1) != 1 or tensor.device != w.device:
            raise ValueError(f"{tensor_name} needs unit stride along its last dim, on {w.device}")


def mxfp8_fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    alpha: float | None,
    limit: float | None,
    *,
    first_expert: int = 0,
    config: TileConfig | MoeGemvConfig | None = None,
    path: str | None = None,
) -> torch.Tensor:
    """``sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])`` as ``[T, H]`` in ``x``'s dtype.

    ``x [T, H]`` bf16 or fp32 (:data:`ACT_DTYPES`, unit stride along H; fp32 never on the ``fp16``
    path); ``w13 [E, 2I, H]`` / ``w2 [E, H, I]`` e4m3 with uint8 scales ``[E, 2I, H/32]`` /
    ``[E, H, I/32]`` (contiguous); ``topk_weights [T, k]`` (fp32 used as is), ``topk_ids [T, k]``
    int32/int64 global ids, local ``id - first_expert`` in ``[0, E)`` or skipped. Expert ``act``:
    swiglu-oai with ``alpha``/``limit``, plain gated silu when both are None. ``path`` (one of
    :data:`PATHS`) overrides :func:`gemm_path` and ``config`` :func:`pick_config` (a
    :class:`TileConfig` applies to the GEMM paths and a ``MoeGemvConfig`` to the GEMV path; the
    other kind is ignored, so one config can be passed whatever the path).
    """
    if x.dim() != 2 or x.dtype not in ACT_DTYPES or (x.shape[1] > 1 and x.stride(1) != 1):
        raise ValueError(f"x must be [tokens, hidden] bf16/fp32 with unit stride along hidden, got {tuple(x.shape)} {x.dtype}")
    tokens, hidden = x.shape
    if w13.dim() != 3:
        raise ValueError(f"w13 must be [experts, 2 * intermediate, hidden], got {tuple(w13.shape)}")
    experts, inter = w13.shape[0], w13.shape[1] // 2
    if hidden % GROUP or inter % GROUP:
        raise ValueError(f"hidden ({hidden}) and intermediate ({inter}) must be multiples of {GROUP} for MXFP8")
    _check_weight("w13", w13, "w13_scale", w13_scale, (experts, 2 * inter, hidden))
    _check_weight("w2", w2, "w2_scale", w2_scale, (experts, hidden, inter))
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != tokens:
        raise ValueError(
            f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must both be [{tokens}, top_k]"
        )
    if (alpha is None) != (limit is None):
        raise ValueError(f"alpha and limit go together (swiglu-oai) or are both None (silu), got {alpha}, {limit}")
    path = path or gemm_path(tokens, x.dtype)
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    if path == "fp16" and x.dtype == torch.float32:
        raise ValueError("fp32 activations cannot take the fp16 path (its prescale rounds them to fp16)")
    ids = topk_ids.contiguous()
    weights = topk_weights.to(torch.float32).contiguous()
    if path == "gemv":
        gemv_config = config if isinstance(config, MoeGemvConfig) else None
        return moe_gemv(x, w13, w13_scale, w2, w2_scale, weights, ids, alpha, limit, first_expert, gemv_config)
    out = torch.empty((tokens, hidden), dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    top_k = topk_ids.shape[1]
    config = config if isinstance(config, TileConfig) else pick_config(tokens, path)
    sorted_slots, block_expert, prescaled = align_and_prescale(
        ids, experts, config.block_m, first_expert, x if path == "fp16" else None
    )
    routing = Routing(ids, weights, sorted_slots, block_expert, top_k, first_expert)
    if path == "widen":
        y = _widen_gemms(x, w13, w13_scale, w2, w2_scale, routing, alpha, limit, config)
    else:
        y = _core_gemms(prescaled or (x, None), w13, w13_scale, w2, w2_scale, routing, alpha, limit, config)
    block_h = min(1024, triton.next_power_of_2(hidden))
    sum_slots_kernel[(tokens, triton.cdiv(hidden, block_h))](
        y, ids, out, hidden, first_expert, experts, TOP_K=top_k, BLOCK_H=block_h, num_warps=4,
    )
    return out


@dataclass(frozen=True)
class Routing:
    """One call's routing as the GEMM launches read it (:func:`align_and_prescale`'s blocks)."""

    ids: torch.Tensor
    weights: torch.Tensor
    sorted_slots: torch.Tensor
    block_expert: torch.Tensor
    top_k: int
    first_expert: int

    @property
    def n_slots(self) -> int:
        return self.ids.numel()

    @property
    def blocks(self) -> int:
        return self.block_expert.shape[0]


def dot_dtype(x: torch.Tensor) -> tl.dtype:
    """The dots' operand dtype for activations ``x`` on the widen and bf16 paths: bf16 on CUDA for
    bf16 ``x``; fp32 for fp32 ``x`` (IEEE, ``mxfp8_gemm.exact_dot``) and under the interpreter,
    which mis-evaluates bf16."""
    return tl.bfloat16 if x.is_cuda and x.dtype == torch.bfloat16 else tl.float32


def _widen_gemms(x, w13, w13_scale, w2, w2_scale, routing: Routing, alpha, limit, config: TileConfig):
    """Steps 2 and 3 on the widen path: ``y [T * k, H]`` per (token, slot), in ``x``'s dtype."""
    tokens, hidden = x.shape
    inter = w13.shape[1] // 2
    launch = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    tiles = {"BLOCK_M": config.block_m, "BLOCK_N": config.block_n, "BLOCK_K": config.block_k, "GROUP_M": config.group_m,
             "DOT_DTYPE": dot_dtype(x)}
    blocks, n_slots = routing.blocks, routing.n_slots
    act = torch.empty((blocks * config.block_m, inter), dtype=x.dtype, device=x.device)
    gate_up_kernel[(blocks * triton.cdiv(inter, config.block_n),)](
        x, w13, w13_scale, act, routing.sorted_slots, routing.block_expert,
        n_slots, blocks, inter, hidden, 0.0 if alpha is None else alpha, 0.0 if limit is None else limit,
        x.stride(0), w13.stride(0), w13.stride(1), w13_scale.stride(0), w13_scale.stride(1), act.stride(0),
        TOP_K=routing.top_k, SWIGLU_OAI=alpha is not None, EVEN_K=hidden % config.block_k == 0, **tiles, **launch,
    )
    y = torch.empty((n_slots, hidden), dtype=x.dtype, device=x.device)
    down_kernel[(blocks * triton.cdiv(hidden, config.block_n),)](
        act, w2, w2_scale, y, routing.weights, routing.sorted_slots, routing.block_expert,
        n_slots, blocks, hidden, inter,
        act.stride(0), w2.stride(0), w2.stride(1), w2_scale.stride(0), w2_scale.stride(1), y.stride(0),
        EVEN_K=inter % config.block_k == 0, **tiles, **launch,
    )
    return y


def _core_gemms(activations, w13, w13_scale, w2, w2_scale, routing: Routing, alpha, limit, config: TileConfig):
    """Steps 2 and 3 on a core path: ``y [T * k, H]`` per (token, slot), in the activations' dtype
    (bf16 from fp16 dots). ``activations``: ``(x16, shifts)`` prescaled for fp16 dots, ``(x, None)``
    for dots in ``x``'s dtype (:func:`dot_dtype`)."""
    x, shifts = activations
    fp16 = shifts is not None
    tokens, hidden = x.shape
    inter = w13.shape[1] // 2
    out_dtype = torch.bfloat16 if fp16 else x.dtype
    dot = tl.float16 if fp16 else dot_dtype(x)
    launch = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    tiles = {"BLOCK_M": config.block_m, "BLOCK_N": config.block_n, "GROUP_M": config.group_m, "DOT_DTYPE": dot}
    blocks, n_slots = routing.blocks, routing.n_slots
    w13_words, groups = scale_words(w13_scale, config.block_k)
    act = torch.empty((blocks * config.block_m, inter), dtype=torch.float32 if fp16 else out_dtype, device=x.device)
    gate_up_core_kernel[(blocks * triton.cdiv(inter, config.block_n // 2),)](
        x, shifts, w13, w13_words, act, routing.sorted_slots, routing.block_expert,
        n_slots, blocks, inter, hidden, 0.0 if alpha is None else alpha, 0.0 if limit is None else limit,
        x.stride(0), w13.stride(0), w13.stride(1), w13_words.stride(0), w13_words.stride(1), act.stride(0),
        TOP_K=routing.top_k, SWIGLU_OAI=alpha is not None, GROUPS=groups, **tiles, **launch,
    )
    act, act_shifts = prescale_rows(act) if fp16 else (act, None)
    w2_words, groups = scale_words(w2_scale, config.block_k)
    y = torch.empty((n_slots, hidden), dtype=out_dtype, device=x.device)
    down_core_kernel[(blocks * triton.cdiv(hidden, config.block_n),)](
        act, act_shifts, w2, w2_words, y, routing.weights, routing.sorted_slots, routing.block_expert,
        n_slots, blocks, hidden, inter,
        act.stride(0), w2.stride(0), w2.stride(1), w2_words.stride(0), w2_words.stride(1), y.stride(0),
        GROUPS=groups, **tiles, **launch,
    )
    return y
