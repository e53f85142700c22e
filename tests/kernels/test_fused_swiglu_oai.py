"""The fused swiglu-oai kernel (``msa_kernels.triton_swiglu_oai``) under the Triton interpreter
against the torch ops it replaces, and the MLP's dispatch (``sglang_m3.models.fused_activation``).

Tolerances are derived in ``tests/fused_act_cases.py``; ``tests/gpu/test_fused_swiglu_oai_gpu.py``
runs the same checks compiled on CUDA at M3's widths.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from fused_act_cases import ALPHA, LIMIT, check_swiglu_oai, gate_up_rows
from fused_norm_cases import assert_nearly_all_identical
from interpreter_only import INTERPRETER_ONLY

from msa_kernels.triton_swiglu_oai import MAX_BLOCK, swiglu_oai
from sglang_m3.models.layers import swiglu_oai as torch_swiglu_oai

pytestmark = INTERPRETER_ONLY


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens,inter", [(1, 96), (7, 200), (33, MAX_BLOCK + 24)])
def test_matches_torch_ops(dtype, tokens, inter):
    """Widths below, at and past one column block (a partial last block masked), odd row counts."""
    gen = torch.Generator().manual_seed(tokens * 1000 + inter)
    counts = [check_swiglu_oai(gate_up_rows(tokens, inter, dtype, gen)) for _ in range(3)]
    if dtype != torch.float32:
        assert_nearly_all_identical(counts)


def test_strided_rows_and_other_constants():
    """A row-strided view of a wider projection, and alpha / limit other than the shipped ones
    (the kernel takes them as arguments, not constants)."""
    gen = torch.Generator().manual_seed(11)
    gate_up = gate_up_rows(16, 160, torch.bfloat16, gen, pad=64)
    assert gate_up.stride(0) == 2 * 160 + 64
    assert_nearly_all_identical([check_swiglu_oai(gate_up), check_swiglu_oai(gate_up, alpha=1.0, limit=3.5)])


def test_clamps_and_special_values():
    """Both clamps (gate above the limit only, up on both sides), zeros, infinities and NaN behave
    as the torch ops do: NaN propagates through the clamps, -inf gates give NaN (inf * 0), +inf
    gates are clamped to the limit."""
    values = [0.0, -0.0, LIMIT, -LIMIT, LIMIT + 5, -LIMIT - 5, 1e-3, -1e-3, 30.0, -30.0, math.inf, -math.inf, math.nan]
    grid = torch.tensor([[g for g in values for _ in values] + [u for _ in values for u in values]], dtype=torch.float32)
    for dtype in (torch.float32, torch.bfloat16):
        gate_up = grid.to(dtype)
        got = swiglu_oai(gate_up, alpha=ALPHA, limit=LIMIT)
        gate, up = gate_up.chunk(2, dim=-1)
        want = torch_swiglu_oai(gate, up, ALPHA, LIMIT)
        assert torch.equal(got.isnan(), want.isnan())
        finite = ~want.isnan()
        assert torch.equal(got[finite], want[finite])


def test_empty_and_refused_shapes():
    assert swiglu_oai(torch.empty(0, 64), alpha=ALPHA, limit=LIMIT).shape == (0, 32)
    with pytest.raises(ValueError, match="2 \\* intermediate"):
        swiglu_oai(torch.zeros(4, 7), alpha=ALPHA, limit=LIMIT)
    with pytest.raises(ValueError, match="2 \\* intermediate"):
        swiglu_oai(torch.zeros(4, 2, 8), alpha=ALPHA, limit=LIMIT)
    with pytest.raises(ValueError, match="unit stride"):
        swiglu_oai(torch.zeros(8, 4).t(), alpha=ALPHA, limit=LIMIT)


def test_dispatch_only_on_cuda_and_switch(monkeypatch):
    """CPU tensors keep the torch ops (the CPU platform's path); the switch takes only 0 or 1."""
    from sglang_m3.models.fused_activation import FUSED_ACT_ENV, GatedActivation, fused_act_on

    x = torch.zeros(2, 8)
    monkeypatch.delenv(FUSED_ACT_ENV, raising=False)
    assert not fused_act_on(x)
    monkeypatch.setenv(FUSED_ACT_ENV, "0")
    assert not fused_act_on(x)
    monkeypatch.setenv(FUSED_ACT_ENV, "yes")
    with pytest.raises(ValueError, match=FUSED_ACT_ENV):
        fused_act_on(x)
    monkeypatch.delenv(FUSED_ACT_ENV)
    gen = torch.Generator().manual_seed(3)
    gate_up = gate_up_rows(5, 24, torch.float32, gen)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(GatedActivation("swigluoai", ALPHA, LIMIT)(gate_up), torch_swiglu_oai(gate, up, ALPHA, LIMIT))
    assert torch.equal(GatedActivation("silu", ALPHA, LIMIT)(gate_up), torch.nn.functional.silu(gate) * up)


@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 5),
    inter=st.integers(1, 70),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    scale=st.sampled_from([0.01, 1.0, 8.0, 300.0]),
    alpha=st.floats(0.1, 4.0),
    limit=st.floats(0.5, 20.0),
    seed=st.integers(0, 2**16),
)
def test_property_random_shapes_scales_and_constants(rows, inter, dtype, scale, alpha, limit, seed):
    """Any row count, any width (odd ones too), magnitudes from tiny to far past the limit (fp16
    overflows to inf in the product at the largest), and any alpha / limit: within the derived
    tolerance of the torch ops."""
    gate_up = gate_up_rows(rows, inter, dtype, torch.Generator().manual_seed(seed), scale=scale)
    check_swiglu_oai(gate_up, alpha=alpha, limit=limit)
