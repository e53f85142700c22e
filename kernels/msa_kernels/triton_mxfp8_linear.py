"""Dense linears with MXFP8 weights and bf16 activations (W8A16) in Triton, for Hopper:
``y = x @ dequant(w).T``; fp16 and fp32 activations too (fp32: W8A32, for fp32 models).

The weight is the checkpoint's: e4m3 ``[N, K]`` with uint8 e8m0 scales ``[N, K/32]``, scale byte
``b`` meaning ``2 ** (b - 127)`` for 32 consecutive elements along K. :func:`mxfp8_linear` runs one
of three ways by the token count (:data:`PATHS`):

- up to :data:`GEMV_MAX_TOKENS` tokens (decode): ``mxfp8_gemv.linear_kernel``, a GEMV without
  ``tl.dot`` (each weight tile converted once and multiplied with every token's row on the FMA
  pipe; the MMA core below pads the tokens to 16 rows and stages every weight tile for the dot),
  K split as below with the same tickets.
- up to :data:`GEMM_MAX_TOKENS` tokens (speculative verify, short chunks): the shared core
  of ``mxfp8_gemm`` (``mx_gemm_rows``: the weights on the MMA's M side, 32-column groups, scale
  factors on the fp32 partial sums) in one launch. The dot runs in the activations' own dtype:
  bf16 activations go to the tensor cores as they are, so no prescale launch is needed (the MoE
  experts prescale to fp16 instead, whose weight conversion is one instruction cheaper per
  element; a dense linear is short enough that a launch costs more than that). M3's dense linears
  under tensor parallelism are narrow (qkv 1280 rows at TP8), too few 32-row tiles to keep every
  SM streaming, so K is split until about four programs per SM run; the last split of a tile to
  finish (an atomic ticket per tile, reset to zero by that program, so CUDA graphs replay it)
  sums the fp32 partials in split order, which keeps the result deterministic.
- beyond it (prefill): the weight dequantized to the activations' dtype on the device
  (``mxfp8_gemm.dequantize``, exact) and one ``torch.matmul``: there the GEMM is bound by FLOPs,
  which cuBLAS does best, and the dequantization is a small share.

Both are exact up to fp32 summation order and the output rounding (every e4m3 value times its
power-of-two scale is a bf16 value). fp32 activations stay fp32 throughout: the GEMV converts e4m3
with Triton's own e4m3 -> fp32 conversion (``mxfp8_gemv.uses_asm``), the core's dots run in IEEE
fp32 (``mxfp8_gemm.exact_dot``, no TF32) and the output is fp32, so the result is the fp32 GEMM of
the dequantized weight up to summation order (the dequantize path's ``torch.matmul`` runs in the
process's fp32 matmul precision, as a plain fp32 linear does: SGLang leaves TF32 off unless asked).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from msa_kernels import mxfp8_gemv
from msa_kernels.mxfp8_gemm import GROUP, dequantize, mx_gemm_rows, scale_words, store_split
from msa_kernels.mxfp8_gemv import sm_count

#: activation dtypes and the core's dot dtype for each on CUDA (under the interpreter, which
#: mis-evaluates bf16, the dots run in fp32: every operand is exact in fp32 as well)
DOT_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
#: largest token count served by the W8A16 kernels; more go through dequantize + matmul
GEMM_MAX_TOKENS = 128
#: largest token count served by the GEMV (``mxfp8_gemv.linear_kernel``), the MMA core beyond: a
#: first guess (issue 17), not timed yet; ``benchmarks/mxfp8_linear.py`` times both at 1-16 tokens
GEMV_MAX_TOKENS = 4
PATHS = ("gemv", "gemm", "dequantize")
#: weight rows and tokens per program, K step (256: one int64 scale word per row, where K allows)
BLOCK_N, BLOCK_M, BLOCK_K = 32, 16, 256
#: warps per program: two, so the dots are mma.sync (``mxfp8_gemm``'s docstring says why)
NUM_WARPS = 2
#: programs per SM the K split aims for (two-warp programs)
PROGRAMS_PER_SM = 4


@triton.jit
def linear_kernel(
    x_ptr, w_ptr, words_ptr, y_ptr, partial_ptr, ticket_ptr,
    T, N, K, steps_per_split, splits,
    stride_xm, stride_wn, stride_sn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    """Program ``(m, s, n)``: tokens ``[m * BLOCK_M, ...)`` times weight rows ``[n * BLOCK_N, ...)``
    over K split ``s``. Token blocks vary fastest, so the programs that read one weight tile run
    together (the tile comes from L2 after the first)."""
    pid_m, pid_s, pid_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    STEP: tl.constexpr = 32 * GROUPS
    k0 = pid_s * steps_per_split * STEP
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tokens = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    acc = mx_gemm_rows(
        w_ptr + k0, words_ptr + k0 // STEP, rows, rows < N, stride_wn, stride_sn,
        x_ptr + k0, tokens, tokens < T, stride_xm, tl.minimum(steps_per_split * STEP, K - k0),
        BLOCK_N, BLOCK_M, GROUPS, DOT_DTYPE,
    )
    y_ptrs = y_ptr + tokens[None, :].to(tl.int64) * stride_ym + rows[:, None]
    y_mask = (tokens < T)[None, :] & (rows < N)[:, None]
    cells = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
    tile = pid_n * tl.num_programs(0) + pid_m
    store_split(acc, cells, y_ptrs, y_mask, partial_ptr, ticket_ptr, tile, pid_s, splits, BLOCK_N * BLOCK_M)


def split_plan(tiles: int, steps: int, sms: int, per_sm: int = PROGRAMS_PER_SM) -> tuple[int, int]:
    """``(splits, steps_per_split)``: K split into about ``per_sm * sms / tiles`` parts of whole K
    steps when ``tiles`` programs alone are fewer than that (every split non-empty)."""
    target = per_sm * sms
    if tiles >= target:
        return 1, steps
    steps_per_split = triton.cdiv(steps, min(steps, triton.cdiv(target, tiles)))
    return triton.cdiv(steps, steps_per_split), steps_per_split


def ticket_count(out_features: int, max_tokens: int = GEMM_MAX_TOKENS) -> int:
    """Tickets :func:`mxfp8_linear` needs for a weight of ``out_features`` rows at any token count
    (the GEMV's tiles, of at least 4 rows and 4 tokens, need no more up to 16 tokens)."""
    return triton.cdiv(out_features, BLOCK_N) * triton.cdiv(max_tokens, BLOCK_M)


def linear_path(tokens: int) -> str:
    """The path (:data:`PATHS`) :func:`mxfp8_linear` takes for ``tokens`` rows (module docstring)."""
    return "gemv" if tokens <= GEMV_MAX_TOKENS else "gemm" if tokens <= GEMM_MAX_TOKENS else "dequantize"


def mxfp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor,
    tickets: torch.Tensor | None = None,
    *,
    splits: int | None = None,
    path: str | None = None,
    gemv_tile: mxfp8_gemv.GemvTile | None = None,
) -> torch.Tensor:
    """``x @ dequant(weight, scales).T`` in ``x``'s dtype, shape ``[*x.shape[:-1], N]``.

    ``x [..., K]`` bf16, fp16 or fp32 (:data:`DOT_DTYPES`) with unit stride along K; ``weight
    [N, K]`` float8_e4m3fn and ``scales [N, K/32]`` uint8, both contiguous. ``tickets``: int32
    zeros, at least :func:`ticket_count` of them, kept by the caller across calls (the kernels
    leave them at zero; allocated per call when None). ``splits`` overrides the K split (tests), ``path`` (one of
    :data:`PATHS`) the choice by token count (:func:`linear_path`; benchmarks), ``gemv_tile``
    ``mxfp8_gemv.linear_gemv_tile`` (benchmark sweeps).
    """
    if x.dtype not in DOT_DTYPES or x.shape[-1] != weight.shape[-1] or x.stride(-1) != 1:
        raise ValueError(f"x must be [..., {weight.shape[-1]}] bf16/fp16/fp32 with unit stride along K, got {tuple(x.shape)} {x.dtype}")
    if weight.dtype != torch.float8_e4m3fn or scales.dtype != torch.uint8 or weight.dim() != 2:
        raise ValueError(f"weight must be float8_e4m3fn [N, K] with uint8 scales, got {weight.dtype} {scales.dtype}")
    rows, cols = weight.shape
    if cols % GROUP or tuple(scales.shape) != (rows, cols // GROUP):
        raise ValueError(f"scales must be [{rows}, {cols // GROUP}] for a weight of {tuple(weight.shape)}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, cols)
    tokens = x2.shape[0]
    path = path or linear_path(tokens)
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    if path == "dequantize":
        return torch.matmul(x2, dequantize(weight, scales, x.dtype).t()).reshape(*lead, rows)
    y = torch.empty((tokens, rows), dtype=x.dtype, device=x.device)
    if tokens == 0:
        return y.reshape(*lead, rows)
    gemv = path == "gemv"
    tile = gemv_tile or mxfp8_gemv.linear_gemv_tile(cols)
    block_m, block_n = (mxfp8_gemv.linear_block_t(tokens), tile.block_n) if gemv else (BLOCK_M, BLOCK_N)
    words, groups = scale_words(scales, tile.block_k if gemv else BLOCK_K)
    steps = cols // (GROUP * groups)
    m_tiles, n_tiles = triton.cdiv(tokens, block_m), triton.cdiv(rows, block_n)
    if splits is None:
        per_sm = mxfp8_gemv.MIN_PROGRAMS_PER_SM if gemv else PROGRAMS_PER_SM
        splits, per_split = split_plan(m_tiles * n_tiles, steps, sm_count(x.device), per_sm)
    else:
        per_split = triton.cdiv(steps, splits)
        splits = triton.cdiv(steps, per_split)
    partials = torch.empty((m_tiles * n_tiles * splits * block_n * block_m,) if splits > 1 else (1,), dtype=torch.float32, device=x.device)
    if splits == 1:
        tickets = torch.empty(1, dtype=torch.int32, device=x.device)  # not touched without a split
    elif tickets is None:
        tickets = torch.zeros(m_tiles * n_tiles, dtype=torch.int32, device=x.device)
    elif tickets.dtype != torch.int32 or tickets.numel() < m_tiles * n_tiles:
        raise ValueError(f"tickets must be at least {m_tiles * n_tiles} int32 zeros, got {tickets.numel()} {tickets.dtype}")
    if gemv:
        w_words = weight.view(torch.int32)
        mxfp8_gemv.linear_kernel[(m_tiles, splits, n_tiles)](
            x2, w_words, words, y, partials, tickets,
            tokens, rows, cols, per_split, splits,
            x2.stride(0), w_words.stride(0), words.stride(0), y.stride(0),
            BLOCK_T=block_m, BLOCK_N=block_n, GROUPS=groups, ASM=mxfp8_gemv.uses_asm(x), num_warps=tile.num_warps,
        )
        return y.reshape(*lead, rows)
    dot_dtype = DOT_DTYPES[x.dtype] if x.is_cuda else tl.float32
    linear_kernel[(m_tiles, splits, n_tiles)](
        x2, weight, words, y, partials, tickets,
        tokens, rows, cols, per_split, splits,
        x2.stride(0), weight.stride(0), words.stride(0), y.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, GROUPS=groups, DOT_DTYPE=dot_dtype, num_warps=NUM_WARPS, num_stages=3,
    )
    return y.reshape(*lead, rows)
