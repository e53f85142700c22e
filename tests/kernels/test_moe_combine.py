"""The weighted combine of a grouped-GEMM MoE (``msa_kernels.triton_moe_combine``) in the Triton
interpreter, against the torch ops it replaces (fp32 accumulation, one rounding)."""

from __future__ import annotations

import pytest
import torch

from msa_kernels.triton_moe_combine import weighted_row_sum, weighted_row_sum_reference


def _case(tokens: int, k: int, hidden: int, rows: int, dtype, seed: int, dropped: float = 0.0):
    gen = torch.Generator().manual_seed(seed)
    table = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype)
    slots = torch.randint(0, rows, (tokens, k), generator=gen)
    slots[torch.rand(tokens, k, generator=gen) < dropped] = -1
    weights = torch.rand(tokens, k, generator=gen)
    return table, slots, weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, k, hidden", [(1, 1, 1), (7, 4, 40), (5, 2, 1030), (3, 5, 1024)])
def test_equals_the_torch_ops(dtype, tokens, k, hidden):
    table, slots, weights = _case(tokens, k, hidden, rows=11, dtype=dtype, seed=tokens * 31 + hidden)
    got = weighted_row_sum(table, slots, weights)
    assert got.dtype == dtype and got.shape == (tokens, hidden)
    # same fp32 products; the sum of k terms may associate differently: one rounding step of the result
    torch.testing.assert_close(got, weighted_row_sum_reference(table, slots, weights), rtol=1e-6 if dtype == torch.float32 else 8e-3, atol=1e-5)


def test_dropped_slots_add_nothing_and_their_rows_are_never_read():
    table, slots, weights = _case(6, 4, 33, rows=9, dtype=torch.float32, seed=5, dropped=0.4)
    assert (slots < 0).any() and (slots >= 0).any()
    poisoned = table.clone()
    poisoned[0] = float("nan")  # a dropped slot's clamped index: must not be read
    used = slots[slots >= 0].unique()
    if (used == 0).any():
        slots[slots == 0] = 1
    got = weighted_row_sum(poisoned, slots, weights)
    assert torch.isfinite(got).all()
    want = sum(torch.where(slots[:, j, None] >= 0, weights[:, j, None] * table[slots[:, j].clamp_min(0)], 0.0) for j in range(4))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)


def test_every_choice_dropped_gives_zero_rows():
    table, slots, weights = _case(3, 2, 16, rows=4, dtype=torch.bfloat16, seed=1)
    slots[1] = -1
    assert (weighted_row_sum(table, slots, weights)[1] == 0).all()


def test_bad_shapes_are_named():
    table, slots, weights = _case(3, 2, 8, rows=4, dtype=torch.float32, seed=2)
    with pytest.raises(ValueError, match="slots and weights"):
        weighted_row_sum(table, slots, weights[:, :1])
    with pytest.raises(ValueError, match="rows must be a contiguous"):
        weighted_row_sum(table.t(), slots, weights)
