"""Model options that transformers' M3 cannot check (it always computes the Gemma norm, the routing
bias and swiglu-oai): float64 references written out here instead."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from m3_config_layouts import shipped_text_config

from sglang_m3.config import M3TextSpec
from sglang_m3.models.checkpoint_layout import expected_text_tensors
from sglang_m3.models.layers import M3RMSNorm


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("gemma", [False, True])
def test_rms_norm_scale_form(gemma):
    torch.manual_seed(0)
    norm = M3RMSNorm(24, 1e-6, gemma=gemma)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(24))
    x = torch.randn(5, 24)
    w = norm.weight.detach().double()
    expected = _rms(x, 1e-6) * (1.0 + w if gemma else w)
    torch.testing.assert_close(norm(x).double(), expected, rtol=1e-6, atol=1e-6)


def test_untouched_norm_is_the_identity_scale_in_both_forms():
    x = torch.randn(3, 8)
    torch.testing.assert_close(M3RMSNorm(8, 1e-6, True)(x), M3RMSNorm(8, 1e-6, False)(x))


def _silu_glu(x, gate_w, up_w, down_w):
    """float64 ``down(silu(gate(x)) * up(x))``."""
    x, gate_w, up_w, down_w = (t.double() for t in (x, gate_w, up_w, down_w))
    gate, up = x @ gate_w.T, x @ up_w.T
    return (gate * torch.sigmoid(gate) * up) @ down_w.T


@pytest.fixture
def silu_spec(tiny_spec):
    return dataclasses.replace(tiny_spec, hidden_act="silu", use_routing_bias=False)


def test_gated_mlp_silu(silu_spec, single_rank):
    from sglang_m3.models.moe import GatedMLP

    torch.manual_seed(1)
    h, inter = silu_spec.hidden_size, 24
    mlp = GatedMLP(silu_spec, inter, reduce_results=True)
    gate_w, up_w, down_w = torch.randn(inter, h) / h**0.5, torch.randn(inter, h) / h**0.5, torch.randn(h, inter) / inter**0.5
    with torch.no_grad():
        mlp.gate_up_proj.weight.copy_(torch.cat([gate_w, up_w]))
        mlp.down_proj.weight.copy_(down_w)
    x = torch.randn(6, h) * 3  # gates beyond the swiglu-oai clamp: a clamp would show
    torch.testing.assert_close(mlp(x).double(), _silu_glu(x, gate_w, up_w, down_w), rtol=1e-5, atol=1e-5)


def test_moe_without_routing_bias_and_with_silu(silu_spec, single_rank):
    from sglang_m3.models.moe import M3SparseMoeBlock

    torch.manual_seed(2)
    spec = silu_spec
    block = M3SparseMoeBlock(spec)
    assert block.e_score_correction_bias is None
    assert not any("e_score_correction_bias" in name for name, _ in block.named_parameters())
    e, h, inter, shared = spec.num_experts, spec.hidden_size, spec.moe_intermediate_size, spec.shared_intermediate_size
    w1, w3 = torch.randn(e, inter, h) / h**0.5, torch.randn(e, inter, h) / h**0.5
    w2 = torch.randn(e, h, inter) / inter**0.5
    sg, su, sd = torch.randn(shared, h) / h**0.5, torch.randn(shared, h) / h**0.5, torch.randn(h, shared) / shared**0.5
    router = torch.randn(e, h) / h**0.5  # sigmoid far from saturation: no float32 ties
    with torch.no_grad():
        block.gate.weight.copy_(router)
        for i in range(e):
            block.load_expert_weight(i, "w1", w1[i])
            block.load_expert_weight(i, "w3", w3[i])
            block.load_expert_weight(i, "w2", w2[i])
        block.shared_experts.gate_up_proj.weight.copy_(torch.cat([sg, su]))
        block.shared_experts.down_proj.weight.copy_(sd)
    x = torch.randn(7, h) * 2

    probs = torch.sigmoid(x.double() @ router.double().T)
    top = probs.topk(spec.experts_per_token, dim=-1)
    weights, chosen = block.route(x)
    assert [set(row) for row in chosen.tolist()] == [set(row) for row in top.indices.tolist()]

    expected = torch.zeros(7, h, dtype=torch.float64)
    for t in range(7):
        norm = top.values[t] / top.values[t].sum()
        for slot, expert in enumerate(top.indices[t].tolist()):
            expected[t] += norm[slot] * _silu_glu(x[t : t + 1], w1[expert], w3[expert], w2[expert])[0]
    expected = expected * spec.routed_scaling_factor + _silu_glu(x, sg, su, sd)
    torch.testing.assert_close(block(x).double(), expected, rtol=1e-5, atol=1e-5)


def test_routing_bias_only_picks_experts(tiny_spec, single_rank):
    """With the bias, the choice follows sigmoid + bias, the weights the raw sigmoid."""
    from sglang_m3.models.moe import M3SparseMoeBlock

    torch.manual_seed(3)
    block = M3SparseMoeBlock(tiny_spec)
    with torch.no_grad():
        block.gate.weight.copy_(torch.randn_like(block.gate.weight))
        block.e_score_correction_bias.copy_(torch.linspace(-1, 1, tiny_spec.num_experts))
    x = torch.randn(5, tiny_spec.hidden_size)
    probs = torch.sigmoid(x.double() @ block.gate.weight.double().T)
    chosen_ref = (probs + block.e_score_correction_bias.double()).topk(tiny_spec.experts_per_token).indices
    weights, chosen = block.route(x)
    assert [set(r) for r in chosen.tolist()] == [set(r) for r in chosen_ref.tolist()]
    picked = probs.gather(1, chosen)
    torch.testing.assert_close(weights.double(), picked / picked.sum(-1, keepdim=True), rtol=1e-6, atol=1e-6)


def test_no_routing_bias_tensor_is_expected(tiny_spec):
    with_bias = expected_text_tensors(tiny_spec)
    without = expected_text_tensors(dataclasses.replace(tiny_spec, use_routing_bias=False))
    biases = {name for name in with_bias if name.endswith("e_score_correction_bias")}
    assert biases and len(biases) == sum(tiny_spec.moe_layers)
    assert set(with_bias) - set(without) == biases


def test_use_routing_bias_false_is_read(shipped_top):
    shipped_top["text_config"]["use_routing_bias"] = False
    assert M3TextSpec.from_config(shipped_top).use_routing_bias is False


@pytest.mark.parametrize(
    "model_type, expected",
    [("minimax_m3_vl_text", "swigluoai"), (None, "silu"), ("minimax_m3", "silu")],
)
def test_silu_means_swigluoai_only_when_transformers_wrote_it(tiny_spec, model_type, expected):
    text = {**shipped_text_config(tiny_spec), "hidden_act": "silu"}
    text.pop("swiglu_beta")
    if model_type:
        text["model_type"] = model_type
    assert M3TextSpec.from_config(text).hidden_act == expected
