"""Routed experts of a prefill-size batch as two grouped GEMMs (torch's CUTLASS ``_grouped_mm``).

Why: on a prefill chunk each expert gets hundreds of rows, and SGLang's Triton fused MoE, even
with the tiles measured best on the H200 (``tune_fused_moe.py``), reaches about 200 TFLOPS there:
8,192 tokens at top-4 took 4.57 ms at TP2 (E=128, N=1536) and 9.02 ms at TP1, a fifth of the
GPU's dense bf16 rate. It was the largest kernel of a 32K-token prefill (47 of 151 ms at TP2).
torch's ``_grouped_mm`` runs one CUTLASS GEMM per expert's rows in a single launch, with the
rows contiguous, so the GEMMs run as dense GEMMs do.

The steps: the (token, choice) pairs sorted by expert (a choice of another expert-parallel
rank's expert sorts last and is left out of every group), each pair's token row gathered once,
the gate-up grouped GEMM, M3's gated activation, the down grouped GEMM, then one Triton pass
(``msa_kernels.triton_moe_combine``) adds each token's outputs back with its routing weights in
fp32. Rounding differs from the fused kernel's only in where the weight is applied (the fused
kernel rounds each weighted output to bf16 before its sum; here the unweighted output is rounded
and the weighted sum is rounded once), within bf16's own noise.

Decode and verify batches stay on the fused kernel (its small-batch tiles stream the weights;
this path exists for large batches). Nothing is read on the host (no sync). Served where
``torch._grouped_mm`` runs its CUTLASS kernel (Hopper, measured on the H200) on bf16 weights;
``SGLANG_M3_GROUPED_MOE_MIN_ROWS`` sets the smallest batch that takes it (0: never).
"""

from __future__ import annotations

import os
from typing import Callable

import torch
from msa_kernels.triton_moe_combine import weighted_row_sum

MIN_ROWS_ENV = "SGLANG_M3_GROUPED_MOE_MIN_ROWS"
#: the smallest batch (rows) that takes the grouped GEMMs by default
DEFAULT_MIN_ROWS = 1024


def grouped_min_rows() -> int:
    """The batch size from which the grouped GEMMs serve (``SGLANG_M3_GROUPED_MOE_MIN_ROWS``;
    0 turns them off)."""
    raw = os.environ.get(MIN_ROWS_ENV, "").strip()
    if not raw:
        return DEFAULT_MIN_ROWS
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{MIN_ROWS_ENV} must be a whole number of rows >= 0 (0 turns the grouped GEMMs off), got {raw!r}")
    return value


def grouped_gemm_serves(weight: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs its CUTLASS kernel for these expert weights: bf16 on a
    Hopper GPU (other GPUs were not measured)."""
    return (
        hasattr(torch, "_grouped_mm")
        and weight.is_cuda
        and weight.dtype == torch.bfloat16
        and torch.cuda.get_device_capability(weight.device)[0] == 9
    )


def sort_by_expert(ids: torch.Tensor, experts: int, first_expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Order of the flattened (token, choice) pairs by local expert, each group's end offset
    (int32, ``experts`` of them) and each pair's position in that order (-1 for a choice outside
    ``first_expert .. first_expert + experts - 1``, which no group holds)."""
    local = ids.reshape(-1).to(torch.int64) - first_expert
    valid = (local >= 0) & (local < experts)
    # sort + searchsorted rather than bincount, whose CUDA kernel reads the largest id on the host
    sorted_key, order = torch.sort(torch.where(valid, local, experts), stable=True)
    ends = torch.searchsorted(sorted_key, torch.arange(experts, device=ids.device), right=True).to(torch.int32)
    position = torch.empty_like(order)
    position[order] = torch.arange(order.numel(), device=order.device)
    return order, ends, torch.where(valid, position, -1).view(ids.shape)


def grouped_experts(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
    activation: Callable[[torch.Tensor], torch.Tensor], first_expert: int = 0,
) -> torch.Tensor:
    """``sum_j weights[t, j] * expert_{ids[t, j]}(x[t])`` for every token ``t``.

    ``w13 [E, 2 * I, H]`` holds each local expert's ``[gate; up]`` rows and ``w2 [E, H, I]`` its
    down projection (SGLang's fused layout); ``ids`` are global expert ids, local expert ``e`` being
    ``first_expert + e``; ``activation`` maps ``[rows, 2 * I]`` to ``[rows, I]``.
    """
    experts, k = w13.shape[0], ids.shape[1]
    order, ends, slots = sort_by_expert(ids, experts, first_expert)
    rows = x.index_select(0, order // k)
    gate_up = torch._grouped_mm(rows, w13.transpose(1, 2), offs=ends)
    out = torch._grouped_mm(activation(gate_up), w2.transpose(1, 2), offs=ends)
    return weighted_row_sum(out, slots, weights)
