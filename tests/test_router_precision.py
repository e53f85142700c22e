"""The MoE router's 16-bit path: only where it equals the fp32 router, never on the CPU.

``prepare_half_router`` keeps a 16-bit copy of the router weight only on CUDA, for a 16-bit model
dtype, and only when the weight is exactly that copy (a bf16 checkpoint's router); everything
else, the CPU platform included, keeps the fp32 linear. The CUDA side (the GEMM itself) is
checked in ``tests/gpu/test_router_gpu.py``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from sglang_m3.models.moe_routing import add_router_parameters, prepare_half_router, router_logits, sigmoid_topk_route


def _block(experts: int = 8, hidden: int = 16) -> nn.Module:
    block = nn.Module()
    add_router_parameters(block, SimpleNamespace(num_experts=experts, hidden_size=hidden, use_routing_bias=True))
    with torch.no_grad():
        block.gate.weight.copy_(torch.randn(experts, hidden, generator=torch.Generator().manual_seed(0)).bfloat16().float())
    return block


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_no_half_router_off_cuda_even_for_exact_weights(dtype):
    block = _block()
    assert block.gate_half is None
    assert prepare_half_router(block, dtype) is False
    assert block.gate_half is None


def test_router_logits_without_a_half_weight_are_the_fp32_linear_of_the_upcast_input():
    block = _block()
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(1)).bfloat16()
    logits = router_logits(block.gate, x)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, x.float() @ block.gate.weight.t(), rtol=0, atol=0)
    weights, chosen, same = sigmoid_topk_route(block.gate, block.e_score_correction_bias, x, 2, block.gate_half)
    torch.testing.assert_close(same, logits, rtol=0, atol=0)
    assert chosen.shape == (5, 2) and torch.allclose(weights.sum(-1), torch.ones(5))


def test_a_half_weight_for_another_dtype_is_not_used():
    """A bf16 weight with fp32 activations (an fp32 server) goes through the fp32 linear."""
    block = _block()
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(2))
    half = block.gate.weight.detach().bfloat16()
    torch.testing.assert_close(router_logits(block.gate, x, half), block.gate(x), rtol=0, atol=0)
