"""Residual add + RMSNorm of M3's hidden states in one Triton pass per row.

Each decoder layer adds a branch output to the residual stream and normalises the sum, twice
(before attention and before the MLP), and the model's final norm follows the last add. Done with
torch ops that is an add plus ~6 kernels of the norm (fp32 upcast, square, mean, rsqrt, two
multiplies, downcast), each a pass over ``[tokens, hidden]``; here it is one read of ``x`` and
the residual and one write of each result.

Rounding follows the torch path of the model (``M3RMSNorm.add_forward``) step by step, so that
results agree to rounding: torch adds two tensors of the model's dtype by upcasting to fp32,
adding and rounding the sum back to that dtype; the norm then reads the *rounded* sum. So the
kernel rounds ``x + residual`` to the input dtype (nearest-even, as ``.to(dtype)``), stores that
as the new residual (bit-identical to torch's), and normalises from it:
``(s32 * rsqrt(mean(s32^2) + eps)) * (weight_offset + w32)`` rounded to the input dtype. Only
the order of the mean's sum and the rsqrt implementation differ from torch (~1e-7 relative).
On CUDA the rsqrt is libdevice's (what torch's CUDA kernel calls) and floating-point contraction
is off (torch rounds each product before the next op).

Grid: one program per row. Graph-safe: nothing is read on the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from msa_kernels.triton_cast import round_cast


@triton.jit
def add_rmsnorm_kernel(
    x_ptr, x_row_stride, r_ptr, r_row_stride, w_ptr, out_ptr, res_out_ptr, eps, w_offset,
    D: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, PRECISE: tl.constexpr,
):
    """Row ``program_id(0)``: ``res_out = x + r`` (rounded) and ``out = rmsnorm(res_out) * scale``."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * r_row_stride + cols, mask=mask, other=0.0)
        x = round_cast(x.to(tl.float32) + r.to(tl.float32), dtype)
        tl.store(res_out_ptr + row * D + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    mean_sq = tl.sum(x32 * x32, axis=0) / D
    if PRECISE:
        rstd = libdevice.rsqrt(mean_sq + eps)
    else:
        rstd = tl.math.rsqrt(mean_sq + eps)
    scale = w_offset + tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * D + cols, round_cast((x32 * rstd) * scale, dtype), mask=mask)


def _check_rows(name: str, t: torch.Tensor, like: torch.Tensor | None) -> None:
    if t.dim() != 2:
        raise ValueError(f"{name} must be [rows, hidden], got shape {tuple(t.shape)}")
    if t.shape[1] > 1 and t.stride(1) != 1:
        raise ValueError(f"{name}'s hidden dim must have unit stride, got strides {t.stride()}")
    if like is not None and (t.shape != like.shape or t.dtype != like.dtype or t.device != like.device):
        raise ValueError(
            f"{name} must match x ({tuple(like.shape)}, {like.dtype}, {like.device}), got ({tuple(t.shape)}, {t.dtype}, {t.device})"
        )


def add_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    *,
    eps: float,
    weight_offset: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rmsnorm(s) * (weight_offset + weight), s)`` with ``s = x + residual`` (``s = x`` when
    ``residual`` is None, returned as is), per row, in one launch.

    ``x`` and ``residual`` are ``[rows, hidden]`` of one dtype (unit stride along hidden, any row
    stride); ``weight [hidden]`` any float dtype. The results are new contiguous tensors in ``x``'s
    dtype (but for ``s`` without a residual).
    """
    _check_rows("x", x, None)
    if residual is not None:
        _check_rows("residual", residual, x)
    rows, hidden = x.shape
    if weight.shape != (hidden,):
        raise ValueError(f"weight must be [{hidden}] (x's hidden size), got {tuple(weight.shape)}")
    out = torch.empty((rows, hidden), dtype=x.dtype, device=x.device)
    summed = x if residual is None else torch.empty_like(out)
    if rows == 0:
        return out, summed
    block = triton.next_power_of_2(hidden)
    precise = x.is_cuda
    source = x if residual is None else residual
    add_rmsnorm_kernel[(rows,)](
        x, x.stride(0), source, source.stride(0), weight, out, summed, eps, weight_offset,
        D=hidden, BLOCK=block, HAS_RESIDUAL=residual is not None, PRECISE=precise,
        num_warps=max(1, min(16, block // 512)),
        **({"enable_fp_fusion": False} if precise else {}),
    )
    return out, summed
