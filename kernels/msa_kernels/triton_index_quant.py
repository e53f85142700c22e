"""fp8 (e4m3) index keys with a per-token power-of-two scale: the Triton side of the quantizer.

The format and why it was chosen are stated once, in :func:`msa_kernels.reference.quantize_index_keys`;
these helpers compute the same bytes inside a kernel (the cache insert), bit for bit, and split a
bf16 query into fp8 terms for the decode scan's fp8 MMA:

* the scale's exponent comes from the integer bits of the row's largest |value| (no division,
  whose GPU form is not correctly rounded);
* values are divided by the scale by multiplying with its exact reciprocal, then rounded to
  e4m3 with integer ops before the (then exact) cast, because the Triton interpreter's
  float32 -> float8 cast mishandles the rounding carry (as its bfloat16 cast does, see
  ``triton_cast``), so the CPU tests would otherwise test a different rounding than the GPU's
  ``cvt.rn``.
"""

import triton
import triton.language as tl

# e4m3's largest finite value; 448 = 1.75 * 2**8, mantissa field of 1.75 in fp32 bits.
_E4M3_MAX = tl.constexpr(448.0)
_E4M3_MAX_EXP = tl.constexpr(8)
_MANTISSA_175 = tl.constexpr(0x600000)
# Below 2**-6 e4m3 is subnormal: a fixed step of 2**-9.
_E4M3_MIN_NORMAL = tl.constexpr(0.015625)
_E4M3_SUBNORMAL_STEPS = tl.constexpr(512.0)
# Adding and subtracting 1.5 * 2**23 rounds an fp32 of magnitude < 2**22 to an integer, to nearest even.
_ROUND_MAGIC = tl.constexpr(12582912.0)
# Row maxima are floored here (as in the reference) so the reciprocal scale stays a finite fp32.
_MIN_ROW_AMAX = tl.constexpr(2.0**-90)


@triton.jit
def _round_to_e4m3(y):
    """fp32 ``y`` (|y| <= 448) rounded to nearest-even on the e4m3 grid; the result is still fp32."""
    bits = y.to(tl.uint32, bitcast=True)
    # normal range: keep 3 mantissa bits (the sign bit is untouched: |y| never carries into it)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
    steps = y * _E4M3_SUBNORMAL_STEPS
    subnormal = ((steps + _ROUND_MAGIC) - _ROUND_MAGIC) / _E4M3_SUBNORMAL_STEPS
    return tl.where(tl.abs(y) < _E4M3_MIN_NORMAL, subnormal, normal)


@triton.jit
def _pow2_scale(amax):
    """(scale, 1 / scale): the smallest power of two ``2**e`` with ``amax <= 448 * 2**e``, and its inverse."""
    bits = tl.maximum(amax, _MIN_ROW_AMAX).to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127 - _E4M3_MAX_EXP + ((bits & 0x7FFFFF) > _MANTISSA_175).to(tl.int32)
    return ((e + 127) << 23).to(tl.float32, bitcast=True), ((127 - e) << 23).to(tl.float32, bitcast=True)


@triton.jit
def quantize_e4m3_row(x):
    """One key row ``x`` (fp32 ``[D]``) -> (its values on the e4m3 grid as fp32, its fp32 scale)."""
    scale, inverse = _pow2_scale(tl.max(tl.abs(x), axis=0))
    y = tl.minimum(tl.maximum(x * inverse, -_E4M3_MAX), _E4M3_MAX)
    return _round_to_e4m3(y), scale


@triton.jit
def e4m3_column_scales(q_first, q_second):
    """Per column of a query held as two pieces of its dimensions (fp32 ``[d, ROWS]`` each, as the
    decode scan's MMAs take them): (scale, 1 / scale), the power of two of :func:`split_e4m3`."""
    return _pow2_scale(tl.maximum(tl.max(tl.abs(q_first), axis=0), tl.max(tl.abs(q_second), axis=0)))


@triton.jit
def split_e4m3(q, inverse):
    """Query columns ``q`` (fp32 ``[d, ROWS]``, bf16 values; ``inverse`` from :func:`e4m3_column_scales`
    over the whole columns) -> fp8 ``hi``, ``lo`` with ``q == (hi + lo / 16) * scale`` exactly.

    Why: the decode scan then feeds fp8 index keys to the MMA as they lie in shared memory (fp8
    MMAs, one per term) instead of widening every key in registers. Why exact: scaled by its
    column's power of two a bf16 value has 8 significant bits; ``hi`` keeps its top 4 (e4m3's), the
    remainder is a multiple of the value's 8th bit no larger than half of ``hi``'s last step, so
    ``16 x`` it fits e4m3's 4 bits as well. Only values below about 2**-15 of the column's largest
    |value| fall into e4m3's subnormals and lose bits there, far under the keys' own e4m3 rounding.
    """
    y = q * inverse[None, :]
    hi = _round_to_e4m3(y)
    lo = _round_to_e4m3((y - hi) * 16.0)
    return hi.to(tl.float8e4nv), lo.to(tl.float8e4nv)
