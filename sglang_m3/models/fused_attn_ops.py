"""The GPU path of M3 attention's small per-layer ops: which path runs, and the fused call.

On CUDA, the per-head q/k norms and partial RoPE of the main and index branches run as one
Triton launch (``msa_kernels.triton_qk_norm_rope``) and the MSA backend stores K, V and the
index key with one more (``msa_kernels.triton_cache_insert``); other devices (the CPU platform)
keep the torch modules of ``layers``, which state the math. ``SGLANG_M3_FUSED_ATTN_OPS=0`` keeps
the torch path on CUDA too, for A/B comparisons.
"""

from __future__ import annotations

import os
from typing import Sequence

import torch
from msa_kernels.triton_qk_norm_rope import HeadGroup, qk_norm_rope

from sglang_m3.models.layers import M3RMSNorm, PartialNeoxRotary

FUSED_ATTN_OPS_ENV = "SGLANG_M3_FUSED_ATTN_OPS"


def fused_attn_ops_on(x: torch.Tensor) -> bool:
    """Whether the fused kernels serve ``x``'s layer: CUDA tensors, unless the env var says 0."""
    value = os.environ.get(FUSED_ATTN_OPS_ENV, "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{FUSED_ATTN_OPS_ENV} must be 0 or 1, got {value!r}")
    return value == "1" and x.is_cuda


def norm_rope_fused(
    positions: torch.Tensor, rotary: PartialNeoxRotary, heads: Sequence[tuple[torch.Tensor, M3RMSNorm]]
) -> list[torch.Tensor]:
    """``rotary(positions, norm(x))`` for every ``(x [T, H, D], norm)`` pair, in one launch.

    The norms of one attention layer share eps and form (they come from one config); a pair
    that differs is refused rather than silently normalised with the first pair's settings.
    """
    first = heads[0][1]
    for _, norm in heads[1:]:
        if (norm.eps, norm.offset) != (first.eps, first.offset):
            raise ValueError("the fused q/k norm needs one eps and one norm form (use_gemma_norm) for all head groups")
    return qk_norm_rope(
        positions,
        rotary.inv_freq.to(positions.device),
        [HeadGroup(x, norm.weight) for x, norm in heads],
        rotary_dim=rotary.rotary_dim,
        eps=first.eps,
        weight_offset=first.offset,
    )
