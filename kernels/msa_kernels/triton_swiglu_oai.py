"""M3's gated activation (swiglu-oai) over a fused ``[gate | up]`` projection in one Triton pass.

M3's dense MLPs and shared experts compute ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``
with ``g = min(gate, limit)`` on the halves of one ``gate_up`` projection. As torch ops that is
seven elementwise kernels over ``[tokens, intermediate]`` (two clamps, the scale, the sigmoid, two
products and the add), each a read and a write of the activations: on an 8K-token prefill chunk
at the dense MLP's width (12,288) they took 1.36 ms on an H100, about a fifth of that MLP's GEMM
time. Here it is one read of ``gate_up`` and one write of the result (0.25 ms there).

Rounding follows the torch path (``sglang_m3.models.layers.swiglu_oai``) op by op, so the two
agree to rounding: torch computes each elementwise op in fp32 and rounds its result to the tensor's
dtype before the next one, so the kernel rounds (nearest-even, as ``.to(dtype)``) after the scale,
the sigmoid, the gated product and the ``+ 1`` as torch does, and the clamps are minimum and maximum
that keep NaN, their results rounded too (a limit the dtype cannot hold, unlike M3's 7, comes out
rounded from torch's clamp). The sigmoid is ``1 / (1 + exp(-x))`` in fp32, the form of torch's CUDA
kernel; on CUDA its ``exp`` is libdevice's (what torch calls), the division IEEE-rounded (Triton's
``/`` on fp32 is an approximate division) and floating-point contraction is off, so only a
last-bit difference of ``exp`` can move a result, by one rounding step of the element.

Grid: one program per (row, block of columns). Graph-safe: nothing is read on the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from msa_kernels.triton_cast import round_cast, round_to

MAX_BLOCK = 1024


@triton.jit
def swiglu_oai_kernel(
    gate_up_ptr, row_stride, out_ptr, alpha, limit,
    INTER: tl.constexpr, BLOCK: tl.constexpr, PRECISE: tl.constexpr,
):
    """Row ``program_id(0)``, columns ``program_id(1) * BLOCK ...``: ``out = act(gate, up)``."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    dtype = out_ptr.dtype.element_ty
    base = gate_up_ptr + row * row_stride
    gate = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(base + INTER + cols, mask=mask, other=0.0).to(tl.float32)
    # a clamped value is the limit rounded to the dtype, as torch's clamp returns it
    gate = round_to(tl.minimum(gate, limit, propagate_nan=tl.PropagateNan.ALL), dtype)
    up = tl.minimum(tl.maximum(up, -limit, propagate_nan=tl.PropagateNan.ALL), limit, propagate_nan=tl.PropagateNan.ALL)
    up = round_to(up, dtype)
    scaled = round_to(gate * alpha, dtype)
    if PRECISE:
        decay = libdevice.exp(-scaled)
    else:
        decay = tl.exp(-scaled)
    sigmoid = round_to(tl.math.div_rn(1.0, 1.0 + decay), dtype)
    gated = round_to(gate * sigmoid, dtype)
    shifted = round_to(up + 1.0, dtype)
    tl.store(out_ptr + row * INTER + cols, round_cast(shifted * gated, dtype), mask=mask)


def swiglu_oai(gate_up: torch.Tensor, *, alpha: float, limit: float) -> torch.Tensor:
    """``act(gate, up)`` of ``gate_up [rows, 2 * inter]`` (gate half first), as a new contiguous
    ``[rows, inter]`` tensor of ``gate_up``'s dtype. Rows may be strided; columns need unit stride.
    """
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [rows, 2 * intermediate], got shape {tuple(gate_up.shape)}")
    if gate_up.shape[1] > 1 and gate_up.stride(1) != 1:
        raise ValueError(f"gate_up's columns must have unit stride, got strides {gate_up.stride()}")
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, inter), dtype=gate_up.dtype, device=gate_up.device)
    if rows == 0 or inter == 0:
        return out
    block = min(MAX_BLOCK, triton.next_power_of_2(inter))
    precise = gate_up.is_cuda
    swiglu_oai_kernel[(rows, triton.cdiv(inter, block))](
        gate_up, gate_up.stride(0), out, alpha, limit,
        INTER=inter, BLOCK=block, PRECISE=precise, num_warps=4,
        **({"enable_fp_fusion": False} if precise else {}),
    )
    return out
