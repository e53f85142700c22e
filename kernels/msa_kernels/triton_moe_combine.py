"""Each token's expert outputs added back, weighted, in one Triton pass.

A grouped-GEMM MoE (``sglang_m3.models.grouped_moe``) computes the experts on rows sorted by
expert, so a token's ``k`` outputs lie scattered over ``rows``. The combine is
``out[t] = sum_j weights[t, j] * rows[slots[t, j]]``, accumulated in fp32 and rounded once to the
rows' dtype; a negative slot (a choice another expert-parallel rank serves) adds nothing and its
row is never read, so rows the GEMMs left uncomputed cannot leak in. As torch ops that is a gather
of ``k`` rows per token into a new tensor, an fp32 copy and a reduction: three passes over the
``[tokens * k, hidden]`` rows, where this reads them once and writes ``[tokens, hidden]`` once.

Grid: one program per (token, block of columns). Graph-safe: nothing is read on the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCK = 1024


@triton.jit
def weighted_row_sum_kernel(
    rows_ptr, slots_ptr, weights_ptr, out_ptr,
    HIDDEN: tl.constexpr, K: tl.constexpr, BLOCK: tl.constexpr,
):
    """Token ``program_id(0)``, columns ``program_id(1) * BLOCK ...``."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(K):
        slot = tl.load(slots_ptr + token * K + j).to(tl.int64)
        weight = tl.load(weights_ptr + token * K + j).to(tl.float32)
        row = tl.load(rows_ptr + tl.maximum(slot, 0) * HIDDEN + cols, mask=mask & (slot >= 0), other=0.0)
        acc += tl.where(slot >= 0, weight, 0.0) * row.to(tl.float32)
    tl.store(out_ptr + token * HIDDEN + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def weighted_row_sum(rows: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum_j weights[t, j] * rows[slots[t, j]]`` over slots ``>= 0``, as a new
    ``[tokens, hidden]`` tensor of ``rows``' dtype (module docstring). ``rows [n, hidden]`` must be
    contiguous; ``slots [tokens, k]`` (integers below ``n``) and ``weights [tokens, k]`` too."""
    if rows.dim() != 2 or not rows.is_contiguous():
        raise ValueError(f"rows must be a contiguous [n, hidden] tensor, got shape {tuple(rows.shape)}, strides {rows.stride()}")
    if slots.dim() != 2 or slots.shape != weights.shape:
        raise ValueError(f"slots and weights must both be [tokens, k], got {tuple(slots.shape)} and {tuple(weights.shape)}")
    tokens, k = slots.shape
    hidden = rows.shape[1]
    out = torch.empty((tokens, hidden), dtype=rows.dtype, device=rows.device)
    if tokens == 0 or hidden == 0:
        return out
    block = min(MAX_BLOCK, triton.next_power_of_2(hidden))
    weighted_row_sum_kernel[(tokens, triton.cdiv(hidden, block))](
        rows, slots.contiguous(), weights.contiguous(), out, HIDDEN=hidden, K=k, BLOCK=block, num_warps=4,
    )
    return out


def weighted_row_sum_reference(rows: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The same sum as torch ops (fp32 accumulation, one rounding), for the tests."""
    picked = rows[slots.clamp_min(0)].float() * torch.where(slots >= 0, weights.float(), 0.0).unsqueeze(-1)
    return picked.sum(dim=1).to(rows.dtype)
