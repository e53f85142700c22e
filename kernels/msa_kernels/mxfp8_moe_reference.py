"""Torch reference of the MXFP8 MoE experts (``triton_mxfp8_moe``): dequantize, then one plain
matmul per chosen expert, all in fp32 from the bf16 inputs.

The arithmetic the kernels must reproduce, written the obvious way: decode each e8m0 byte ``b``
to ``2 ** (b - 127)`` (byte 0 -> 0.0), multiply it into its 32 weights, then for every held expert
``e`` and the (token, slot) pairs routed to it: ``act(x @ gate_e.T, x @ up_e.T) @ w2_e.T`` times
the pair's routed weight, summed per token. It reads the routing on the host (a loop over the hit
experts), so it is for tests and benchmark checks only.
"""

from __future__ import annotations

import torch

GROUP = 32


def dequantize(elements: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """e4m3 ``[..., N, K]`` with uint8 e8m0 ``[..., N, K/32]`` -> fp32 ``[..., N, K]``."""
    factors = (scales.to(torch.int32) << 23).view(torch.float32)
    values = elements.to(torch.float32).unflatten(-1, (-1, GROUP)) * factors.unsqueeze(-1)
    return values.flatten(-2)


def expert_activation(gate: torch.Tensor, up: torch.Tensor, alpha: float | None, limit: float | None) -> torch.Tensor:
    """swiglu-oai ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``, ``g = min(gate, limit)``;
    plain ``silu(gate) * up`` when ``alpha`` is None."""
    if alpha is None:
        return torch.nn.functional.silu(gate) * up
    gate = gate.clamp(max=limit)
    return (up.clamp(-limit, limit) + 1.0) * (gate * torch.sigmoid(alpha * gate))


def reference_fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    alpha: float | None,
    limit: float | None,
    *,
    first_expert: int = 0,
) -> torch.Tensor:
    """fp32 ``[T, H]``: same arguments and meaning as ``triton_mxfp8_moe.mxfp8_fused_experts``."""
    xf = x.float()
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    inter = w13.shape[1] // 2
    local_ids = topk_ids.long() - first_expert
    for expert in torch.unique(local_ids).tolist():
        if not 0 <= expert < w13.shape[0]:
            continue
        token, slot = torch.where(local_ids == expert)
        gate_up = xf[token] @ dequantize(w13[expert], w13_scale[expert]).T
        act = expert_activation(gate_up[:, :inter], gate_up[:, inter:], alpha, limit)
        down = act @ dequantize(w2[expert], w2_scale[expert]).T
        out.index_add_(0, token, down * topk_weights[token, slot].float()[:, None])
    return out
