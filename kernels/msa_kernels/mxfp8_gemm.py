"""The W8A16 MXFP8 GEMM core shared by the MoE experts and the dense linears: few-token GEMMs
whose e4m3 weights go to the tensor cores as they are (and its W8A32 form for fp32 models).

Decode is bound by reading the weights, and a Hopper SM has only a few instructions per weight
byte to spare at full HBM bandwidth (about 9 per element and lane on an H100). Widening each
element to bf16 with its scale in fp32 costs about that much on its own (e4m3 -> f16 -> f32,
multiply, round to bf16, plus the layout shuffles of the group broadcast), so the kernels that did
it streamed at 2.5 TB/s at best. Here the per-element work is one conversion per two elements:

- The weights become fp16 in registers with one ``cvt.rn.f16x2.e4m3x2`` per pair (exact: every
  e4m3 value, subnormals included, is an fp16 value) and the MMA runs in fp16 with fp32
  accumulation (the products of an e4m3 and an fp16 value are exact in fp32).
- The e8m0 scales are not applied to the weights at all: each K step of ``32 * groups`` columns
  runs one dot per 32-column group and multiplies that group's fp32 partial sums by the group's
  factor ``2 ** (b - 127)`` per weight row (an exact power of two) before adding them up. That is
  one multiply-add per accumulator element and group, not one per weight element. The scale
  bytes of a step are read as one word per row (``groups`` bytes, up to 8, :func:`scale_words`)
  and prefetched a step ahead by hand, since Triton's pipeliner leaves loads that feed no dot
  operand in place (the weights and activations it pipelines ``num_stages`` deep; a second
  loop-carried prefetch made Triton 3.8 drop that pipelining altogether).
- The activations must be fp16, whose range (65504) bf16 activations can exceed: each row is
  multiplied by a power of two ``2 ** s`` chosen from its largest magnitude (:func:`prescale_row`,
  the largest lands in ``[2**14, 2**15)``), which is exact for bf16 and fp16 inputs (fp32 rows,
  the MoE's activation, round once to fp16's 11 bits), and the epilogue multiplies by ``2 ** -s``
  (:func:`unscale`). Elements more than ``2**28`` below their
  row's largest fall into fp16's subnormals and keep fewer bits: an absolute error below
  ``2**-39`` of the row's largest magnitude, far under bf16's rounding of that largest element.

So the result equals an fp32 GEMM of the exact dequantized weights with the bf16 activations up
to fp32 summation order. Weights sit on the MMA's M side and the few tokens on N ("swap AB"), so
a 16-token tile does not pad the weight side. Callers launch it with fewer than four warps per
program, so the dots compile to ``mma.sync``: a wgmma here is waited for in every group before
its partial sums can be scaled, which measured slower than widening every weight to bf16. The
same loop can run its dots in bf16 instead (``DOT_DTYPE``), for callers to which a prescale
launch costs more than one more instruction per weight element (the dense linears), or in fp32
for fp32 activations (an fp32 model: IEEE fp32 dots through :func:`exact_dot`, no TF32, so the
result is the fp32 GEMM of the dequantized weights up to summation order; Triton runs such dots on
the FMA pipe, which only an exactness run pays for). :func:`dequantize` is the conversion alone,
for the GEMMs that are bound by FLOPs rather than bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from msa_kernels.triton_cast import round_cast

GROUP = 32  # elements per e8m0 scale along K
#: scale-word dtype per number of 32-column groups it covers
WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
#: columns per chunk of :func:`prescale_row` (two passes over a row: its largest magnitude, then the scaled copy)
PRESCALE_BLOCK = 1024
#: rows per program of :func:`dequantize`
DEQUANTIZE_ROWS = 32


def scale_words(scales: torch.Tensor, block_k: int) -> tuple[torch.Tensor, int]:
    """``(words, groups)``: the uint8 scales ``[..., K/32]`` viewed as ``[..., K/32/groups]`` words
    of ``groups`` consecutive bytes (byte ``g`` of a word, little-endian, is group ``g`` of a K step
    of ``32 * groups`` columns). ``groups`` is the largest of ``block_k / 32`` halved until it divides
    ``K/32``, so a K step never runs past K. No copy: the scales must be contiguous."""
    groups = max(1, min(8, block_k // GROUP))
    while scales.shape[-1] % groups:
        groups //= 2
    return scales.view(WORD_DTYPES[groups]), groups


@triton.jit
def group_factors(words, g: tl.constexpr):
    """fp32 ``2 ** (b - 127)`` of byte ``g`` of each scale word (byte 0 -> 0.0, as SGLang decodes)."""
    return (((words >> (8 * g)) & 0xFF).to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def exact_dot(a, b, acc):
    """``tl.dot(a, b, acc)``; fp32 operands in IEEE fp32 (Triton's default is TF32, which rounds them
    to 10 mantissa bits: the W8A32 paths must equal an fp32 GEMM up to summation order), 16-bit
    operands as ``tl.dot`` runs them by default."""
    if a.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def mx_gemm_rows(
    w_ptr, words_ptr, rows, row_ok, stride_wn, stride_sn,
    x_ptr, x_rows, x_ok, stride_xm, K,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, GROUPS: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    """``acc[n, m] = sum_k dequant(w)[rows[n], k] * x[x_rows[m], k]`` in fp32, ``[BLOCK_N, BLOCK_M]``.

    ``w_ptr`` e4m3 ``[*, K]`` (row stride ``stride_wn``), ``words_ptr`` its scale words
    (:func:`scale_words`, row stride ``stride_sn`` in words), ``x_ptr`` ``DOT_DTYPE`` ``[*, K]`` (row
    stride ``stride_xm``); rows outside ``row_ok`` / ``x_ok`` read as zeros. ``K`` is a multiple of
    ``32 * GROUPS``. ``DOT_DTYPE`` fp16 (prescaled activations, one conversion per weight pair) or
    bf16 (activations as they are, exact too: every e4m3 value is a bf16 value; the weights'
    conversion then costs one more instruction per element, an ``f16 -> bf16`` step); fp32 for
    fp32 activations (IEEE dots, :func:`exact_dot`) and under the Triton interpreter, which
    mis-evaluates bf16 (every operand is exact in fp32 as well).
    """
    ks = tl.arange(0, 32)
    w_ptrs = w_ptr + rows[:, None].to(tl.int64) * stride_wn + ks[None, :]
    x_ptrs = x_ptr + x_rows[:, None].to(tl.int64) * stride_xm + ks[None, :]
    words_ptrs = words_ptr + rows.to(tl.int64) * stride_sn
    STEP: tl.constexpr = 32 * GROUPS
    words = tl.load(words_ptrs, mask=row_ok, other=0)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, STEP):
        next_words = tl.load(words_ptrs + (k0 // STEP + 1), mask=row_ok & (k0 + STEP < K), other=0)
        for g in tl.static_range(GROUPS):
            xt = tl.trans(tl.load(x_ptrs + g * 32, mask=x_ok[:, None], other=0.0)).to(DOT_DTYPE)
            w = tl.load(w_ptrs + g * 32, mask=row_ok[:, None], other=0.0)
            acc += exact_dot(w.to(DOT_DTYPE), xt, None) * group_factors(words, g)[:, None]
        w_ptrs += STEP
        x_ptrs += STEP
        words = next_words
    return acc


@triton.jit
def store_split(acc, cells, y_ptrs, y_mask, partial_ptr, ticket_ptr, tile, split, splits, CELLS: tl.constexpr):
    """Stores one K split's fp32 sums ``acc`` of output tile ``tile`` at ``y_ptrs`` (rounded to their
    dtype, where ``y_mask``): at once without a split (``splits`` 1); otherwise into the tile's
    slot ``split`` of ``partial_ptr`` (``CELLS`` floats a slot, ``cells`` numbering ``acc``'s), and
    the last split of the tile to arrive (an atomic ticket, which it resets to zero, so CUDA graphs
    replay it) sums the partials in split order: deterministic. Shared by the MMA core's and the
    GEMV's split-K linears."""
    if splits == 1:
        tl.store(y_ptrs, round_cast(acc, y_ptrs.dtype.element_ty), mask=y_mask)
    else:
        partials = partial_ptr + tile.to(tl.int64) * splits * CELLS + cells
        tl.store(partials + split * CELLS, acc)
        tl.debug_barrier()  # every thread's partial stores precede the release of the ticket
        if tl.atomic_add(ticket_ptr + tile, 1, sem="acq_rel", scope="gpu") == splits - 1:
            total = tl.zeros(acc.shape, dtype=tl.float32)
            for s in range(splits):
                total += tl.load(partials + s * CELLS, cache_modifier=".cg")
            tl.store(y_ptrs, round_cast(total, y_ptrs.dtype.element_ty), mask=y_mask)
            tl.atomic_xchg(ticket_ptr + tile, 0, sem="relaxed", scope="gpu")  # zero again for the next launch


@triton.jit
def prescale_row(x_ptr, out_ptr, shift_ptr, row, cols, stride_x, stride_o, BLOCK: tl.constexpr):
    """Row ``row`` of ``x`` (bf16, fp16 or fp32) times ``2 ** s`` into fp16 ``out``, and ``s`` into
    ``shift[row]``: ``s`` brings the row's largest magnitude into ``[2**14, 2**15)`` (an all-zero
    row gets the largest ``s``, 126; ``s`` stays in ``[-126, 126]`` so both ``2 ** s`` and
    ``2 ** -s`` are normal fp32)."""
    x_ptr += row.to(tl.int64) * stride_x
    out_ptr += row.to(tl.int64) * stride_o
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for c0 in range(0, cols, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        amax = tl.maximum(amax, tl.abs(tl.load(x_ptr + c, mask=c < cols, other=0.0).to(tl.float32)))
    biased_exponent = (tl.max(amax, axis=0).to(tl.int32, bitcast=True) >> 23) & 0xFF
    shift = tl.minimum(tl.maximum(141 - biased_exponent, -126), 126)
    factor = ((shift + 127) << 23).to(tl.float32, bitcast=True)
    for c0 in range(0, cols, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + c, mask=c < cols, other=0.0).to(tl.float32)
        tl.store(out_ptr + c, (v * factor).to(tl.float16), mask=c < cols)
    tl.store(shift_ptr + row, shift)


@triton.jit
def unscale(shifts):
    """fp32 ``2 ** -s`` for the :func:`prescale_row` shifts ``s`` (undoes the prescale exactly)."""
    return ((127 - shifts) << 23).to(tl.float32, bitcast=True)


@triton.jit
def prescale_rows_kernel(x_ptr, out_ptr, shift_ptr, cols, stride_x, stride_o, BLOCK: tl.constexpr):
    """One program per row: :func:`prescale_row`."""
    prescale_row(x_ptr, out_ptr, shift_ptr, tl.program_id(0), cols, stride_x, stride_o, BLOCK)


def prescale_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x16 [T, K] fp16, shifts [T] int32)`` with ``x16 = x * 2 ** shifts[:, None]``
    (:func:`prescale_row`: exact for bf16 and fp16 ``x``, fp32 rounds once); ``x`` is ``[T, K]``
    with unit stride along K."""
    rows, cols = x.shape
    x16 = torch.empty((rows, cols), dtype=torch.float16, device=x.device)
    shifts = torch.empty(rows, dtype=torch.int32, device=x.device)
    if rows:
        prescale_rows_kernel[(rows,)](x, x16, shifts, cols, x.stride(0), x16.stride(0), BLOCK=PRESCALE_BLOCK, num_warps=4)
    return x16, shifts


@triton.jit
def dequantize_kernel(
    w_ptr, words_ptr, out_ptr, N, stride_wn, stride_sn, stride_on, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr,
):
    """``out = dequant(w)`` for ``BLOCK_N`` rows and one K step of ``32 * GROUPS`` columns per
    program: each e4m3 element times its group factor in fp32 (exact), stored in ``out``'s dtype."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    step = tl.program_id(1)
    words = tl.load(words_ptr + rows.to(tl.int64) * stride_sn + step, mask=row_ok, other=0)
    for g in tl.static_range(GROUPS):
        ks = step * 32 * GROUPS + g * 32 + tl.arange(0, 32)
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * stride_wn + ks[None, :], mask=row_ok[:, None], other=0.0)
        values = w.to(tl.float32) * group_factors(words, g)[:, None]
        tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_on + ks[None, :], values.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def dequantize(weight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """e4m3 ``[N, K]`` with uint8 e8m0 scales ``[N, K/32]`` (contiguous) -> ``dtype`` ``[N, K]``, in
    one pass on the device (the same values as ``sglang_m3.quant.mxfp8.dequantize``)."""
    rows, cols = weight.shape
    words, groups = scale_words(scales, 8 * GROUP)
    out = torch.empty((rows, cols), dtype=dtype, device=weight.device)
    if rows and cols:
        grid = (triton.cdiv(rows, DEQUANTIZE_ROWS), cols // (GROUP * groups))
        dequantize_kernel[grid](
            weight, words, out, rows, weight.stride(0), words.stride(0), out.stride(0),
            BLOCK_N=DEQUANTIZE_ROWS, GROUPS=groups, num_warps=4,
        )
    return out
