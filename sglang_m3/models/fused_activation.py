"""The GPU path of the MLPs' gated activation: which path runs, and the call.

M3's dense MLPs and shared experts apply swiglu-oai to the halves of one ``gate_up`` projection.
On CUDA that is one Triton launch (``msa_kernels.triton_swiglu_oai``, rounded as the torch ops
round); other devices (the CPU platform) and plain SiLU gating keep the torch ops of
``layers.gated_activation``, which state the math. ``SGLANG_M3_FUSED_ACT=0`` keeps the torch path
on CUDA too, for A/B comparisons. (The routed experts' activation is inside SGLang's fused MoE.)
"""

from __future__ import annotations

import torch
from msa_kernels.triton_swiglu_oai import swiglu_oai

from sglang_m3.env_switch import env_choice
from sglang_m3.models.layers import gated_activation

FUSED_ACT_ENV = "SGLANG_M3_FUSED_ACT"


def fused_act_on(x: torch.Tensor) -> bool:
    """Whether the fused kernel serves ``x``: CUDA tensors, unless ``SGLANG_M3_FUSED_ACT`` is 0."""
    return env_choice(FUSED_ACT_ENV, ("1", "0"), "'1' (fused kernel on CUDA) or '0'") == "1" and x.is_cuda


class GatedActivation:
    """``act(gate_up)`` for the config's ``hidden_act``: the fused kernel where it serves, else
    the torch ops of ``layers.gated_activation`` on the two halves."""

    def __init__(self, hidden_act: str, alpha: float, limit: float):
        self.swiglu_oai = hidden_act != "silu"
        self.alpha, self.limit = alpha, limit
        self.torch_act = gated_activation(hidden_act, alpha, limit)

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.swiglu_oai and fused_act_on(gate_up):
            return swiglu_oai(gate_up, alpha=self.alpha, limit=self.limit)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.torch_act(gate, up)
