"""Torch reference of the MXFP8 MoE experts (``triton_mxfp8_moe``): dequantize, then one plain
matmul per chosen expert, all in fp32 from the bf16 or fp32 inputs.

The arithmetic the kernels must reproduce, written the obvious way: decode each e8m0 byte ``b``
to ``2 ** (b - 127)`` (byte 0 -> 0.0), multiply it into its 32 weights, then for every held expert
``e`` and the (token, slot) pairs routed to it: ``act(x @ gate_e.T, x @ up_e.T) @ w2_e.T`` times
the pair's routed weight, summed per token. It reads the routing on the host (a loop over the hit
experts), so it is for tests and benchmark checks only. :func:`assert_fp32_close` is the W8A32
tolerance the fp32-activation tests of the MoE and dense-linear kernels share.
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


#: W8A32 tolerance (fp32 activations) against the fp32 reference, per element as a share of the
#: output's largest magnitude and as relative Frobenius error. The kernels and the reference then
#: multiply the same exact fp32 operands (e4m3 -> fp32 is exact, the e8m0 factors are powers of
#: two) and differ only in summation order: measured up to 4.4e-7 of the largest output on the
#: interpreter tests' shapes; fp32 against fp64 differs by 5e-7 (relative Frobenius 4.6e-7) at
#: M3's real expert and linear shapes (CPU torch). One 16-bit rounding anywhere (bf16 2**-9, TF32
#: 2**-11, fp16 2**-12 relative) moves both to 1e-4 or more (a bf16 activation: 2.2e-3).
FP32_MAX_ERROR = 2.0**-16
FP32_REL_ERROR = 1e-5


def assert_fp32_close(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """An fp32 result ``got`` against the fp32 reference ``want`` (compared in fp64) within
    :data:`FP32_MAX_ERROR` and :data:`FP32_REL_ERROR`; returns ``(largest |got - want| over
    max |want|, relative Frobenius error)``."""
    assert got.dtype == torch.float32 and got.shape == want.shape, (got.dtype, tuple(got.shape), tuple(want.shape))
    assert torch.isfinite(got).all(), "non-finite output"
    got, want = got.double(), want.double()
    worst = ((got - want).abs().max() / want.abs().max()).item()
    rel = ((got - want).norm() / want.norm()).item()
    assert worst <= FP32_MAX_ERROR, f"max |error| {worst:.3e} of the largest output, over {FP32_MAX_ERROR:.3e}"
    assert rel <= FP32_REL_ERROR, f"relative Frobenius error {rel:.3e} over {FP32_REL_ERROR:.3e}"
    return worst, rel
