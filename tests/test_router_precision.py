"""The MoE router's 16-bit path: only where it equals the fp32 router, never on the CPU.

``prepare_half_router`` writes the fp32 router weight as at most three 16-bit parts whose exact sum
is the weight, only on CUDA and for a 16-bit model dtype; everything else, the CPU platform
included, keeps the fp32 linear. The split itself runs anywhere and is checked here, with random
and extreme fp32 values (hypothesis): the parts must sum to the weight exactly (in float64), the
fewest parts are used, and a weight they cannot hold gets none. The CUDA side (the GEMM over the
parts) is checked in ``tests/gpu/test_router_gpu.py``.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from torch import nn

from sglang_m3.models.moe_routing import (
    MAX_ROUTER_PARTS,
    add_router_parameters,
    prepare_half_router,
    router_logits,
    sigmoid_topk_route,
    split_into_16bit_parts,
)


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


def _sum_in_float64(parts: torch.Tensor, experts: int) -> torch.Tensor:
    return parts.double().view(-1, experts, parts.shape[-1]).sum(0)


def test_a_bf16_exact_weight_is_one_part():
    weight = _block().gate.weight.detach()
    parts = split_into_16bit_parts(weight, torch.bfloat16)
    assert parts.dtype == torch.bfloat16 and parts.shape == weight.shape
    assert torch.equal(parts.float(), weight)


def test_a_random_fp32_weight_takes_three_bf16_parts_summing_to_it_exactly():
    weight = torch.randn(16, 64, generator=torch.Generator().manual_seed(3)) * 64**-0.5
    parts = split_into_16bit_parts(weight, torch.bfloat16)
    assert parts.shape == (MAX_ROUTER_PARTS * 16, 64)
    assert torch.equal(_sum_in_float64(parts, 16), weight.double())
    # largest part first: each later part is below half a bf16 ulp of the one before
    first, second = parts[:16].float().abs(), parts[16:32].float().abs()
    assert bool((second <= first * 2.0**-8).all())


finite_fp32 = st.floats(width=32, allow_nan=False, allow_infinity=False)


@settings(max_examples=200, deadline=None)
@given(arrays(np.float32, st.tuples(st.integers(1, 4), st.integers(1, 9)), elements=finite_fp32))
def test_any_bf16_split_is_exact_and_none_only_outside_bf16s_range(values):
    weight = torch.from_numpy(values.copy())
    parts = split_into_16bit_parts(weight, torch.bfloat16)
    if parts is None:
        # bf16 shares fp32's exponent range but neither its deepest subnormals (a value below
        # 2**-110 may hold bits below bf16's 2**-133) nor its top (above bf16's largest finite value)
        tiny = (weight != 0) & (weight.abs() < 2.0**-110)
        huge = weight.abs() > torch.finfo(torch.bfloat16).max
        assert bool((tiny | huge).any())
    else:
        assert parts.dtype == torch.bfloat16 and parts.shape[0] % weight.shape[0] == 0
        assert parts.shape[0] // weight.shape[0] <= MAX_ROUTER_PARTS
        assert torch.equal(_sum_in_float64(parts, weight.shape[0]), weight.double())


@settings(max_examples=200, deadline=None)
@given(arrays(np.float32, st.tuples(st.integers(1, 4), st.integers(1, 9)), elements=finite_fp32))
def test_an_fp16_split_is_exact_whenever_it_is_given(values):
    weight = torch.from_numpy(values.copy())
    parts = split_into_16bit_parts(weight, torch.float16)
    if parts is not None:
        assert torch.equal(_sum_in_float64(parts, weight.shape[0]), weight.double())
        assert bool(torch.isfinite(parts).all())


@pytest.mark.parametrize("value", [1e5, -7e4, 1e-9])
def test_weights_outside_fp16s_range_get_no_fp16_parts(value):
    weight = torch.full((2, 3), value)
    assert split_into_16bit_parts(weight, torch.float16) is None
