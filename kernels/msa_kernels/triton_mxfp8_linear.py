"""Dense linears with MXFP8 weights and bf16 activations (W8A16) in Triton, for Hopper:
``y = x @ dequant(w).T``.

The weight is the checkpoint's: e4m3 ``[N, K]`` with uint8 e8m0 scales ``[N, K/32]``, scale byte
``b`` meaning ``2 ** (b - 127)`` for 32 consecutive elements along K. :func:`mxfp8_linear` runs one
of two ways by the token count:

- up to :data:`GEMM_MAX_TOKENS` tokens (decode, speculative verify, short chunks): the shared core
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
power-of-two scale is a bf16 value).
"""

from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

from msa_kernels.mxfp8_gemm import GROUP, dequantize, mx_gemm_rows, scale_words
from msa_kernels.triton_cast import round_cast

#: largest token count served by the W8A16 kernel; more go through dequantize + matmul
GEMM_MAX_TOKENS = 128
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
    if splits == 1:
        tl.store(y_ptrs, round_cast(acc, y_ptr.dtype.element_ty), mask=y_mask)
    else:
        tile = pid_n * tl.num_programs(0) + pid_m
        cells = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
        partials = partial_ptr + tile.to(tl.int64) * splits * BLOCK_N * BLOCK_M + cells
        tl.store(partials + pid_s * BLOCK_N * BLOCK_M, acc)
        tl.debug_barrier()  # every thread's partial stores precede the release of the ticket
        if tl.atomic_add(ticket_ptr + tile, 1, sem="acq_rel", scope="gpu") == splits - 1:
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for s in range(splits):
                total += tl.load(partials + s * BLOCK_N * BLOCK_M, cache_modifier=".cg")
            tl.store(y_ptrs, round_cast(total, y_ptr.dtype.element_ty), mask=y_mask)
            tl.atomic_xchg(ticket_ptr + tile, 0, sem="relaxed", scope="gpu")  # zero again for the next launch


@lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def split_plan(tiles: int, steps: int, sms: int) -> tuple[int, int]:
    """``(splits, steps_per_split)``: K split into about ``PROGRAMS_PER_SM * sms / tiles`` parts of
    whole K steps when ``tiles`` programs alone are fewer than that (every split non-empty)."""
    target = PROGRAMS_PER_SM * sms
    if tiles >= target:
        return 1, steps
    steps_per_split = triton.cdiv(steps, min(steps, triton.cdiv(target, tiles)))
    return triton.cdiv(steps, steps_per_split), steps_per_split


def ticket_count(out_features: int, max_tokens: int = GEMM_MAX_TOKENS) -> int:
    """Tickets :func:`mxfp8_linear` needs for a weight of ``out_features`` rows at any token count."""
    return triton.cdiv(out_features, BLOCK_N) * triton.cdiv(max_tokens, BLOCK_M)


def mxfp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor,
    tickets: torch.Tensor | None = None,
    *,
    splits: int | None = None,
    path: str | None = None,
) -> torch.Tensor:
    """``x @ dequant(weight, scales).T`` in ``x``'s dtype, shape ``[*x.shape[:-1], N]``.

    ``x [..., K]`` bf16 or fp16 with unit stride along K; ``weight [N, K]`` float8_e4m3fn and
    ``scales [N, K/32]`` uint8, both contiguous. ``tickets``: int32 zeros, at least
    :func:`ticket_count` of them, kept by the caller across calls (the kernel leaves them at zero;
    allocated per call when None). ``splits`` overrides the K split (tests), ``path`` ("gemm" or
    "dequantize") the choice by :data:`GEMM_MAX_TOKENS` (benchmarks).
    """
    if x.dtype not in (torch.bfloat16, torch.float16) or x.shape[-1] != weight.shape[-1] or x.stride(-1) != 1:
        raise ValueError(f"x must be [..., {weight.shape[-1]}] bf16/fp16 with unit stride along K, got {tuple(x.shape)} {x.dtype}")
    if weight.dtype != torch.float8_e4m3fn or scales.dtype != torch.uint8 or weight.dim() != 2:
        raise ValueError(f"weight must be float8_e4m3fn [N, K] with uint8 scales, got {weight.dtype} {scales.dtype}")
    rows, cols = weight.shape
    if cols % GROUP or tuple(scales.shape) != (rows, cols // GROUP):
        raise ValueError(f"scales must be [{rows}, {cols // GROUP}] for a weight of {tuple(weight.shape)}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, cols)
    tokens = x2.shape[0]
    path = path or ("gemm" if tokens <= GEMM_MAX_TOKENS else "dequantize")
    if path not in ("gemm", "dequantize"):
        raise ValueError(f"path must be 'gemm' or 'dequantize', got {path!r}")
    if path == "dequantize":
        return torch.matmul(x2, dequantize(weight, scales, x.dtype).t()).reshape(*lead, rows)
    y = torch.empty((tokens, rows), dtype=x.dtype, device=x.device)
    if tokens == 0:
        return y.reshape(*lead, rows)
    words, groups = scale_words(scales, BLOCK_K)
    steps = cols // (GROUP * groups)
    m_tiles, n_tiles = triton.cdiv(tokens, BLOCK_M), triton.cdiv(rows, BLOCK_N)
    if splits is None:
        splits, per_split = split_plan(m_tiles * n_tiles, steps, _sm_count(x.device))
    else:
        per_split = triton.cdiv(steps, splits)
        splits = triton.cdiv(steps, per_split)
    partials = torch.empty((m_tiles * n_tiles * splits * BLOCK_N * BLOCK_M,) if splits > 1 else (1,), dtype=torch.float32, device=x.device)
    if splits == 1:
        tickets = torch.empty(1, dtype=torch.int32, device=x.device)  # not touched without a split
    elif tickets is None:
        tickets = torch.zeros(m_tiles * n_tiles, dtype=torch.int32, device=x.device)
    elif tickets.dtype != torch.int32 or tickets.numel() < m_tiles * n_tiles:
        raise ValueError(f"tickets must be at least {m_tiles * n_tiles} int32 zeros, got {tickets.numel()} {tickets.dtype}")
    dot_dtype = (tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float16) if x.is_cuda else tl.float32
    linear_kernel[(m_tiles, splits, n_tiles)](
        x2, weight, words, y, partials, tickets,
        tokens, rows, cols, per_split, splits,
        x2.stride(0), weight.stride(0), words.stride(0), y.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, GROUPS=groups, DOT_DTYPE=dot_dtype, num_warps=NUM_WARPS, num_stages=3,
    )
    return y.reshape(*lead, rows)
