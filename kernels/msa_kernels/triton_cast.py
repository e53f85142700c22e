"""Rounding casts shared by the small fused kernels.

``round_cast`` rounds fp32 to the target dtype to nearest-even, the way torch's ``.to(dtype)``
does. For bf16 it rounds with integer ops before the (then exact) cast, because the Triton
interpreter's float32 -> bfloat16 cast truncates (and mishandles the carry of its "rtne" mode),
so the CPU tests would otherwise test different rounding than the GPU runs. On the GPU the
integer form costs a few ALU ops in memory-bound kernels and rounds exactly like ``cvt.rn``.
"""

import triton
import triton.language as tl


@triton.jit
def round_cast(x, dtype: tl.constexpr):
    """fp32 ``x`` rounded to nearest-even into ``dtype`` (NaN stays NaN)."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        rounded = bits.to(tl.float32, bitcast=True)
        return tl.where(x != x, x, rounded).to(dtype)
    else:
        return x.to(dtype)
