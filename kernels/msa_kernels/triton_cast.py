"""Rounding casts shared by the small fused kernels.

``round_cast`` rounds fp32 to the target dtype to nearest-even, the way torch's ``.to(dtype)``
does. For bf16 it rounds with integer ops and reinterprets the upper 16 bits as the result, never
converting: the Triton interpreter's float32 -> bfloat16 conversion truncates (and mishandles the
carry of its "rtne" mode) and flushes subnormals to zero, so the CPU tests would otherwise test
different rounding than the GPU runs. On the GPU the integer form costs a few ALU ops in
memory-bound kernels and gives the bits ``cvt.rn`` gives. ``round_to`` is the same rounding with
the result kept in fp32, for kernels that round between ops as torch does and compute on.
"""

import triton
import triton.language as tl

BF16_QUIET_NAN = tl.constexpr(0x7FC0)  # what torch makes of any NaN


@triton.jit
def _bf16_bits(x):
    """The bf16 nearest (ties to even) to fp32 ``x``, as its 16 bits in a uint32 (NaN: quiet NaN)."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return tl.where(x != x, BF16_QUIET_NAN, rounded)


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """fp32 ``x`` rounded to nearest-even to a value of ``dtype``, returned in fp32."""
    if dtype == tl.bfloat16:
        return (_bf16_bits(x) << 16).to(tl.float32, bitcast=True)
    elif dtype == tl.float16:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@triton.jit
def round_cast(x, dtype: tl.constexpr):
    """fp32 ``x`` rounded to nearest-even into ``dtype`` (NaN stays NaN)."""
    if dtype == tl.bfloat16:
        return _bf16_bits(x).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)
