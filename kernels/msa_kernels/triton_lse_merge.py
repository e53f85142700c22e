"""Two partial attentions over disjoint keys merged by their log-sum-exp, in one Triton pass.

The dense layers attend a chunk after a cached prefix as two cuDNN calls, the prefix unmasked and
the chunk causally (``sglang_m3.msa.dense_prefill.prefix_split_sdpa``), each returning its output
and its softmax normaliser per (token, head). Merged as torch ops in fp32 that is seven passes over
``[tokens, heads, head_dim]``: two widening copies, two scalings, the sum, the division and the
narrowing copy, about 3.6 GB of traffic for an 8K-token chunk at 64 heads of 128, against 0.4 GB
for one read of both outputs and one write of the result.

Arithmetic and rounding are :func:`merge_by_lse_reference`'s op for op, in fp32: the larger
normaliser as the pivot, each weight ``exp(lse - pivot)``, the outputs widened and scaled, summed,
divided by the sum of the weights (IEEE division; Triton's ``/`` on fp32 is approximate) and
rounded to nearest-even into the outputs' dtype. On CUDA ``exp`` is libdevice's (what torch's CUDA
kernel calls) and floating-point contraction is off, so that the result is the torch form's bit for
bit (``tests/gpu/test_dense_prefix_split_gpu.py`` asserts it; it passed on an H200 at 51c2367); under
the interpreter ``exp`` is numpy's, which may move a weight by its last bit.

Grid: one program per (token, block of heads). Graph-safe: nothing is read on the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from msa_kernels.triton_cast import round_cast

#: heads per program: 16 rows of a 128-wide head dim keep a program's tile at 2,048 elements
MAX_HEAD_BLOCK = 16


@triton.jit
def lse_merge_kernel(
    a_ptr, a_stride_token, a_stride_head, lse_a_ptr, lse_a_stride_token, lse_a_stride_head,
    b_ptr, b_stride_token, b_stride_head, lse_b_ptr, lse_b_stride_token, lse_b_stride_head,
    out_ptr, heads, dim,
    BLOCK_HEADS: tl.constexpr, BLOCK_DIM: tl.constexpr, PRECISE: tl.constexpr,
):
    """Token ``program_id(0)``, heads ``program_id(1) * BLOCK_HEADS ...``: the merged rows."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
    col = tl.arange(0, BLOCK_DIM)
    head_in = head < heads
    mask = head_in[:, None] & (col[None, :] < dim)
    lse_a = tl.load(lse_a_ptr + token * lse_a_stride_token + head * lse_a_stride_head, mask=head_in, other=0.0)
    lse_b = tl.load(lse_b_ptr + token * lse_b_stride_token + head * lse_b_stride_head, mask=head_in, other=0.0)
    pivot = tl.maximum(lse_a, lse_b, propagate_nan=tl.PropagateNan.ALL)
    if PRECISE:  # libdevice's exp, as torch's CUDA exp; the interpreter has no libdevice
        weight_a, weight_b = libdevice.exp(lse_a - pivot), libdevice.exp(lse_b - pivot)
    else:
        weight_a, weight_b = tl.exp(lse_a - pivot), tl.exp(lse_b - pivot)
    a = tl.load(a_ptr + token * a_stride_token + head[:, None] * a_stride_head + col[None, :], mask=mask, other=0.0)
    b = tl.load(b_ptr + token * b_stride_token + head[:, None] * b_stride_head + col[None, :], mask=mask, other=0.0)
    total = a.to(tl.float32) * weight_a[:, None] + b.to(tl.float32) * weight_b[:, None]
    merged = tl.math.div_rn(total, (weight_a + weight_b)[:, None])
    tl.store(out_ptr + (token * heads + head[:, None]) * dim + col[None, :], round_cast(merged, out_ptr.dtype.element_ty), mask=mask)


def merge_by_lse(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """:func:`merge_by_lse_reference` in one pass: a new contiguous ``[tokens, heads, dim]`` tensor of
    ``out_a``'s dtype. Outputs and normalisers (``[tokens, heads, 1]`` fp32) may be strided views
    (the attention ops' heads-first results transposed); the outputs' last dim needs unit stride."""
    check_merge_operands(out_a, lse_a, out_b, lse_b)
    tokens, heads, dim = out_a.shape
    out = torch.empty((tokens, heads, dim), dtype=out_a.dtype, device=out_a.device)
    if out.numel() == 0:
        return out
    block_heads = min(MAX_HEAD_BLOCK, triton.next_power_of_2(heads))
    precise = out_a.is_cuda
    lse_a, lse_b = lse_a[..., 0], lse_b[..., 0]  # views: [tokens, heads] with the normalisers' strides
    lse_merge_kernel[(tokens, triton.cdiv(heads, block_heads))](
        out_a, out_a.stride(0), out_a.stride(1), lse_a, lse_a.stride(0), lse_a.stride(1),
        out_b, out_b.stride(0), out_b.stride(1), lse_b, lse_b.stride(0), lse_b.stride(1),
        out, heads, dim,
        BLOCK_HEADS=block_heads, BLOCK_DIM=triton.next_power_of_2(dim), PRECISE=precise, num_warps=4,
        **({"enable_fp_fusion": False} if precise else {}),
    )
    return out


def check_merge_operands(out_a, lse_a, out_b, lse_b) -> None:
    """Refuse operands the kernel would read wrongly, naming the one at fault."""
    if out_a.dim() != 3 or out_b.shape != out_a.shape or out_b.dtype != out_a.dtype:
        raise ValueError(f"the partial outputs must be [tokens, heads, dim] of one shape and dtype, got "
                         f"{tuple(out_a.shape)} {out_a.dtype} and {tuple(out_b.shape)} {out_b.dtype}")
    if out_a.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"the partial outputs must be bf16, fp16 or fp32, got {out_a.dtype}")
    if out_a.shape[2] > 1 and (out_a.stride(2) != 1 or out_b.stride(2) != 1):
        raise ValueError(f"the partial outputs need unit stride along dim, got strides {out_a.stride()} and {out_b.stride()}")
    tokens, heads = out_a.shape[:2]
    for name, lse in (("lse_a", lse_a), ("lse_b", lse_b)):
        if lse.dtype != torch.float32 or lse.shape != (tokens, heads, 1):
            raise ValueError(f"{name} must be fp32 [{tokens}, {heads}, 1], got {lse.dtype} {tuple(lse.shape)}")
    if any(t.device != out_a.device for t in (lse_a, out_b, lse_b)):
        raise ValueError("the partial outputs and their normalisers must be on one device")


def merge_by_lse_reference(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """Attention over the union of two disjoint key sets from each set's output ``[tokens, heads,
    dim]`` and log-sum-exp normaliser ``[tokens, heads, 1]`` (fp32): the outputs weighted by their
    share of the total softmax mass, computed in fp32 (or wider) and returned in ``out_a``'s dtype."""
    pivot = torch.maximum(lse_a, lse_b)
    weight_a, weight_b = torch.exp(lse_a - pivot), torch.exp(lse_b - pivot)
    wide = torch.promote_types(out_a.dtype, torch.float32)
    merged = (out_a.to(wide) * weight_a + out_b.to(wide) * weight_b) / (weight_a + weight_b)
    return merged.to(out_a.dtype)
