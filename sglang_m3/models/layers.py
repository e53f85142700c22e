"""Small torch-native building blocks of M3 that every platform runs as they are.

They are written out here (rather than taken from SGLang's fused custom ops) because M3's
variants differ in details that decide exactness: the Gemma norm scales by ``1 + w`` after an
fp32 normalisation (``use_gemma_norm``; plain ``w`` otherwise), RoPE rotates only the first
``rotary_dim`` channels (NeoX halves), and the expert activation is the clamped "swiglu-oai" form
with separate gate and up halves (``hidden_act`` "swigluoai"; plain SiLU gating for "silu").
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


class M3RMSNorm(nn.Module):
    """``x * rsqrt(mean(x^2) + eps) * scale``, normalised in fp32, over the last dimension.

    ``scale`` is ``1 + w`` in the Gemma form M3 ships with (``use_gemma_norm`` true; ``w``
    starts at 0) and ``w`` otherwise (``w`` starts at 1), so an untouched norm is the identity
    scale in both forms.
    """

    def __init__(self, dim: int, eps: float, gemma: bool):
        super().__init__()
        self.eps = eps
        self.offset = 1.0 if gemma else 0.0
        self.weight = nn.Parameter(torch.zeros(dim) if gemma else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (self.offset + self.weight.float())).to(x.dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(self(s), s)`` with ``s = residual + x`` added in ``x``'s dtype (``s = x`` without a
        residual): a decoder layer's residual add and the norm after it, in the order the model
        always ran them. The fused GPU kernel (``msa_kernels.triton_add_rmsnorm``) follows this."""
        summed = x if residual is None else residual + x
        return self(summed), summed


class PartialNeoxRotary(nn.Module):
    """NeoX (rotate-half) RoPE on the first ``rotary_dim`` channels of each head, at absolute positions."""

    def __init__(self, rotary_dim: int, theta: float):
        super().__init__()
        self.rotary_dim = rotary_dim
        inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, *heads: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Rotate each ``[tokens, num_heads, head_dim]`` tensor of ``heads`` in a new tensor."""
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
        return tuple(self._rotate(x, cos, sin) for x in heads)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot, keep = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        half = self.rotary_dim // 2
        rotated_half = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
        out = rot.float() * cos.to(torch.float) + rotated_half.float() * sin.to(torch.float)
        return torch.cat((out.to(x.dtype), keep), dim=-1)


def gated_activation(hidden_act: str, alpha: float, limit: float) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``act(gate, up)`` for the config's ``hidden_act`` ("swigluoai" or "silu")."""
    if hidden_act == "silu":
        return lambda gate, up: F.silu(gate) * up
    return lambda gate, up: swiglu_oai(gate, up, alpha, limit)


def swiglu_oai(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """M3's expert activation: ``(clamp(up) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, limit)``."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1.0) * (gate * torch.sigmoid(gate * alpha))
