"""The fused MoE routing kernel (``sglang_m3.models.router_topk``) against the torch routing it
replaces, ``moe_routing.fused_layer_routing`` (``sigmoid_topk``, then the fused layer's scale,
int32 ids and shared-slot column: ``M3FusedMoeBlock.route`` without the switch).

On a CPU machine the kernel runs under the Triton interpreter (numpy's ``exp`` in the sigmoid, so
probabilities may differ from torch's by a rounding); with CUDA the same tests run it compiled,
on libdevice's ``exp`` as torch's CUDA sigmoid. Either way the chosen experts must be the torch
path's exactly and the weights equal to a few roundings; the order of the ids (descending biased
score, ties to the lower id) is the kernel's own and is checked on its own.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_m3.models.moe_routing import fused_layer_routing as torch_route
from sglang_m3.models.router_topk import FUSED_ROUTE_ENV, fused_route_on, fused_route_serves, route_topk

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SCALE = 2.0  # M3's routed_scaling_factor
#: a weight is a quotient of sums of at most 8 probabilities, times the scale: a few fp32 roundings
WEIGHT_RTOL = 8 * 2.0**-24


def by_expert(weights, ids):
    order = ids.argsort(dim=1)
    return weights.gather(1, order), ids.gather(1, order)


def random_logits(rows, experts, seed, bias=True):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, experts, generator=gen) * 3).to(DEVICE)
    correction = (torch.randn(experts, generator=gen) * 0.2).to(DEVICE) if bias else None
    return logits, correction


@pytest.mark.parametrize(
    "rows,experts,top_k,bias,shared",
    [
        (1, 128, 4, True, None),  # a decode row of the mid-size M3
        (1, 128, 4, True, 128),  # the shared expert as slot 128 of the fused layer
        (8, 128, 8, True, 128),
        (37, 128, 4, False, None),  # no correction bias
        (5, 256, 8, True, None),
        (6, 96, 6, True, 96),  # experts not a power of two (padded lanes)
        (3, 40, 1, True, None),
        (2, 16, 16, True, None),  # every expert chosen
        (300, 64, 4, True, 64),  # a prefill chunk's many rows
    ],
)
def test_same_experts_and_weights_as_the_torch_routing(rows, experts, top_k, bias, shared):
    logits, correction = random_logits(rows, experts, seed=rows * 1000 + experts + top_k, bias=bias)
    got_weights, got_ids = route_topk(logits, correction, top_k, SCALE, shared)
    want_weights, want_ids = torch_route(logits, correction, top_k, SCALE, shared)
    columns = top_k + (shared is not None)
    assert got_weights.shape == got_ids.shape == (rows, columns)
    assert got_weights.dtype == torch.float32 and got_ids.dtype == torch.int32
    routed = slice(0, top_k)
    got_w, got_i = by_expert(got_weights[:, routed], got_ids[:, routed])
    want_w, want_i = by_expert(want_weights[:, routed], want_ids[:, routed])
    assert torch.equal(got_i, want_i)
    torch.testing.assert_close(got_w, want_w, rtol=WEIGHT_RTOL, atol=0.0)
    if shared is not None:
        assert torch.equal(got_ids[:, top_k], torch.full_like(got_ids[:, top_k], shared))
        assert torch.equal(got_weights[:, top_k], torch.ones_like(got_weights[:, top_k]))


@settings(max_examples=25, deadline=None)
@given(
    experts=st.integers(1, 300), rows=st.integers(0, 4), k_share=st.floats(0.0, 1.0), bias=st.booleans(),
    shared=st.booleans(), seed=st.integers(0, 2**16),
)
def test_any_shape_routes_as_the_torch_ops(experts, rows, k_share, bias, shared, seed):
    top_k = 1 + round(k_share * (min(experts, 8) - 1))
    logits, correction = random_logits(rows, experts, seed, bias)
    slot = experts if shared else None
    got_weights, got_ids = route_topk(logits, correction, top_k, SCALE, slot)
    want_weights, want_ids = torch_route(logits, correction, top_k, SCALE, slot)
    assert got_ids.shape == want_ids.shape and got_weights.shape == want_weights.shape
    got_w, got_i = by_expert(got_weights, got_ids)
    want_w, want_i = by_expert(want_weights, want_ids)
    assert torch.equal(got_i, want_i)
    torch.testing.assert_close(got_w, want_w, rtol=WEIGHT_RTOL, atol=0.0)


def test_ids_come_by_descending_biased_score_ties_to_the_lower_id():
    experts = 32
    logits = torch.zeros(2, experts, device=DEVICE)  # every probability 0.5
    bias = torch.zeros(experts, device=DEVICE)
    bias[[7, 20, 3]] = torch.tensor([0.3, 0.2, 0.1], device=DEVICE)
    weights, ids = route_topk(logits, bias, 6, SCALE)
    # 7, 20 and 3 by their bias, then the tied rest from the lowest id
    assert ids.tolist() == [[7, 20, 3, 0, 1, 2]] * 2
    # the bias picks them but does not weigh them: six equal probabilities
    torch.testing.assert_close(weights, torch.full((2, 6), SCALE / 6, device=DEVICE), rtol=WEIGHT_RTOL, atol=0.0)


def test_bias_chooses_and_the_raw_probabilities_weigh():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]], device=DEVICE)
    bias = torch.tensor([0.0, 0.0, 0.0, 1.0], device=DEVICE)  # lifts expert 3, the least likely, to the top
    weights, ids = route_topk(logits, bias, 2, 1.0)
    assert ids.tolist() == [[3, 0]]
    probs = torch.sigmoid(logits[0, [3, 0]])
    torch.testing.assert_close(weights[0], probs / probs.sum(), rtol=WEIGHT_RTOL, atol=0.0)


def test_a_nan_logit_ranks_first_as_in_torch_topk():
    logits, bias = random_logits(3, 64, seed=5)
    logits[1, 17] = float("nan")
    _, ids = route_topk(logits, bias, 4, SCALE)
    _, want = torch_route(logits, bias, 4, SCALE)
    assert ids[1, 0].item() == 17 and 17 in want[1].tolist()
    assert ((ids >= 0) & (ids < 64)).all()
    assert torch.equal(by_expert(ids.float(), ids)[1][[0, 2]], by_expert(want.float(), want)[1][[0, 2]])


def test_logits_rows_with_a_stride():
    wide, bias = random_logits(4, 160, seed=9)
    logits = wide[:, :128]  # rows 160 apart
    got_weights, got_ids = route_topk(logits, bias[:128], 4, SCALE)
    want_weights, want_ids = route_topk(logits.contiguous(), bias[:128], 4, SCALE)
    assert torch.equal(got_ids, want_ids) and torch.equal(got_weights, want_weights)


def test_no_rows():
    weights, ids = route_topk(torch.empty(0, 128, device=DEVICE), None, 4, SCALE, shared_slot=128)
    assert weights.shape == ids.shape == (0, 5)


@pytest.mark.parametrize(
    "logits,bias,top_k,message",
    [
        (torch.zeros(2, 8, dtype=torch.float16), None, 2, "fp32 logits"),
        (torch.zeros(8), None, 2, "fp32 logits"),
        (torch.zeros(8, 2).t(), None, 1, "unit stride"),
        (torch.zeros(2, 8), None, 9, "top_k = 9"),
        (torch.zeros(2, 8), None, 0, "top_k = 0"),
        (torch.zeros(2, 8), torch.zeros(7), 2, "correction bias"),
        (torch.zeros(2, 8), torch.zeros(8, dtype=torch.float64), 2, "correction bias"),
    ],
)
def test_refuses_inputs_it_cannot_route(logits, bias, top_k, message):
    with pytest.raises(ValueError, match=message):
        route_topk(logits.to(DEVICE), None if bias is None else bias.to(DEVICE), top_k, SCALE)


def test_the_switch_is_on_by_default_on_cuda_only_and_refuses_other_values(monkeypatch):
    logits = torch.zeros(1, 8)
    monkeypatch.delenv(FUSED_ROUTE_ENV, raising=False)
    assert fused_route_on()
    assert not fused_route_serves(logits)  # CPU logits keep the torch ops
    if torch.cuda.is_available():
        assert fused_route_serves(logits.cuda())
    monkeypatch.setenv(FUSED_ROUTE_ENV, "0")
    assert not fused_route_on()
    if torch.cuda.is_available():
        assert not fused_route_serves(logits.cuda())
    monkeypatch.setenv(FUSED_ROUTE_ENV, "on")
    with pytest.raises(ValueError, match=FUSED_ROUTE_ENV):
        fused_route_serves(logits)
