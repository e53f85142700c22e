"""The GPU path of the decoder layers' residual add + RMSNorm: which path runs, and the call.

M3's decoder layers carry the residual stream beside the branch output (SGLang's convention), so
that each add can be fused into the norm after it. On CUDA that pair is one Triton launch
(``msa_kernels.triton_add_rmsnorm``); other devices (the CPU platform) run
``M3RMSNorm.add_forward``, the torch ops the model always ran. ``SGLANG_M3_FUSED_NORM=0`` keeps
the torch path on CUDA too, for A/B comparisons.
"""

from __future__ import annotations

import os

import torch
from msa_kernels.triton_add_rmsnorm import add_rmsnorm as add_rmsnorm_kernel

from sglang_m3.models.layers import M3RMSNorm

FUSED_NORM_ENV = "SGLANG_M3_FUSED_NORM"
_SWITCH = {"1": True, "0": False}


def add_rmsnorm(norm: M3RMSNorm, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(s), s)`` with ``s = residual + x`` (``x`` without a residual); see ``M3RMSNorm.add_forward``."""
    if fused_norm_on(x):
        return add_rmsnorm_kernel(x, residual, norm.weight, eps=norm.eps, weight_offset=norm.offset)
    return norm.add_forward(x, residual)


def fused_norm_on(x: torch.Tensor) -> bool:
    """Whether the fused kernel serves ``x``: CUDA tensors, unless ``SGLANG_M3_FUSED_NORM`` is 0."""
    setting = os.environ.get(FUSED_NORM_ENV, "1").strip()
    if setting not in _SWITCH:
        raise ValueError(f"{FUSED_NORM_ENV} must be 0 or 1 (1 = fused kernel on CUDA), got {setting!r}")
    return x.is_cuda and _SWITCH[setting]
