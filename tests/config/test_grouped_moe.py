"""The grouped-GEMM routed experts (``sglang_m3.models.grouped_moe``) on the CPU.

torch's ``_grouped_mm`` has a CPU form, and the combine kernel runs in the Triton interpreter, so
the whole path runs here in fp32 against a per-expert loop over the same weights, also with the
expert ids of an expert-parallel rank (another rank's choices dropped); the served bf16 path on
the GPU is ``tests/gpu/test_grouped_moe_gpu.py``. Also: the sort's group offsets and slots
(hypothesis), the switch's parsing, and which batches of the fused block take the path.
"""

from __future__ import annotations

import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_m3.models.grouped_moe import MIN_ROWS_ENV, grouped_experts, grouped_min_rows, sort_by_expert


def _act(inter: int):
    return lambda gate_up: torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]


def _loop_reference(x, ids, weights, w13, w2, act, first_expert):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j]) - first_expert
            if 0 <= e < w13.shape[0]:
                out[t] += weights[t, j] * (act(x[t : t + 1] @ w13[e].T) @ w2[e].T)[0]
    return out


@pytest.mark.parametrize("first_expert, global_experts", [(0, 6), (0, 12), (6, 12)])
def test_equals_a_loop_over_experts(first_expert, global_experts):
    gen = torch.Generator().manual_seed(first_expert + global_experts)
    tokens, hidden, inter, experts, k = 29, 24, 8, 6, 3
    x = torch.randn(tokens, hidden, generator=gen)
    w13, w2 = torch.randn(experts, 2 * inter, hidden, generator=gen), torch.randn(experts, hidden, inter, generator=gen)
    ids = torch.stack([torch.randperm(global_experts, generator=gen)[:k] for _ in range(tokens)]).to(torch.int32)
    weights = torch.rand(tokens, k, generator=gen)
    got = grouped_experts(x, ids, weights, w13, w2, _act(inter), first_expert)
    want = _loop_reference(x, ids, weights, w13, w2, _act(inter), first_expert)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 9), st.integers(1, 4), st.integers(1, 7), st.integers(0, 2), st.randoms(use_true_random=False))
def test_sort_groups_each_local_choice_once(tokens, k, experts, rank, rng):
    """Every choice of a local expert sits in its expert's group, once; the others are in none."""
    ids = torch.tensor([[rng.randrange(-1, 3 * experts) for _ in range(k)] for _ in range(tokens)], dtype=torch.int32)
    first = rank * experts
    order, ends, slots = sort_by_expert(ids, experts, first)
    starts = [0, *ends.tolist()[:-1]]
    flat = ids.reshape(-1).tolist()
    for e, (start, end) in enumerate(zip(starts, ends.tolist())):
        assert sorted(order[start:end].tolist()) == [i for i, v in enumerate(flat) if v == first + e]
    for i, value in enumerate(flat):
        local = 0 <= value - first < experts
        slot = slots.reshape(-1)[i].item()
        assert (slot >= 0) == local
        if local:
            assert order[slot].item() == i


def test_min_rows_switch(monkeypatch):
    monkeypatch.delenv(MIN_ROWS_ENV, raising=False)
    assert grouped_min_rows() == 1024
    monkeypatch.setenv(MIN_ROWS_ENV, "0")
    assert grouped_min_rows() == 0
    for bad in ("-1", "many", "1.5"):
        monkeypatch.setenv(MIN_ROWS_ENV, bad)
        with pytest.raises(ValueError, match=MIN_ROWS_ENV):
            grouped_min_rows()


def _block(min_rows: int, shared_slot, experts=4, hidden=8, inter=3):
    """Just enough of an ``M3FusedMoeBlock`` for ``routed``: weights with a shared slot after the routed ones."""
    from sglang_m3.models.fused_moe import M3FusedMoeBlock

    slots = experts + int(shared_slot is not None)
    w13, w2 = torch.randn(slots, 2 * inter, hidden), torch.randn(slots, hidden, inter)
    block = types.SimpleNamespace(grouped_min_rows=min_rows, shared_slot=shared_slot, first_expert=4,
                                  experts=types.SimpleNamespace(w13_weight=w13, w2_weight=w2))
    block.takes_grouped = lambda x: M3FusedMoeBlock.takes_grouped(block, x)
    block.halves_act = _act(inter)
    return block


def test_takes_grouped_needs_the_rows_and_a_grouped_gemm(monkeypatch):
    from sglang_m3.models import fused_moe
    from sglang_m3.models.fused_moe import M3FusedMoeBlock

    block = _block(16, None)
    monkeypatch.setattr(fused_moe, "grouped_gemm_serves", lambda weight: True)
    assert [M3FusedMoeBlock.takes_grouped(block, torch.zeros(rows, 8)) for rows in (15, 16, 900)] == [False, True, True]
    assert not M3FusedMoeBlock.takes_grouped(block, torch.zeros(16, 7)), "padded weights (SGLANG_MOE_PADDING) must keep the fused kernel"
    block.grouped_min_rows = 0
    assert not M3FusedMoeBlock.takes_grouped(block, torch.zeros(900, 8))
    monkeypatch.undo()
    block.grouped_min_rows = 1
    assert not M3FusedMoeBlock.takes_grouped(block, torch.zeros(900, 8)), "CPU tensors have no CUTLASS grouped GEMM"


def test_routed_hands_the_grouped_gemms_the_routed_experts_only(monkeypatch):
    """The shared slot (the last expert) stays out of the groups, and the rank's first expert id goes along."""
    from sglang_m3.models import fused_moe
    from sglang_m3.models.fused_moe import M3FusedMoeBlock

    block = _block(2, shared_slot=4)
    ids = torch.tensor([[4, 7], [5, 6], [7, 4]], dtype=torch.int32)
    weights = torch.rand(3, 2)
    block.route = lambda x: (weights, ids, None)
    monkeypatch.setattr(fused_moe, "grouped_gemm_serves", lambda weight: True)
    seen = {}
    monkeypatch.setattr(fused_moe, "grouped_experts", lambda *args: seen.setdefault("args", args) and "grouped")
    x = torch.randn(3, 8)
    assert M3FusedMoeBlock.routed(block, x) == "grouped"
    _, got_ids, got_weights, w13, w2, act, first = seen["args"]
    assert w13.shape[0] == w2.shape[0] == 4 and first == 4
    assert torch.equal(w13, block.experts.w13_weight[:4]) and got_ids is ids and got_weights is weights
    assert act is block.halves_act
