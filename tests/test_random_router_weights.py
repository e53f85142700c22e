"""Random weights (``--load-format dummy``) stand for the published checkpoint, whose MoE routers
are BF16: after SGLang's dummy loader the fp32 router parameters hold BF16 values, so a benchmark
on random weights runs the router a real checkpoint gives. A checkpoint load keeps its fp32 values."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

import sglang_m3.models.minimax_m3 as minimax_m3
from sglang_m3.models.minimax_m3 import PUBLISHED_ROUTER_DTYPE, MiniMaxM3SparseForCausalLM, weights_are_random
from sglang_m3.models.moe_routing import add_router_parameters


class _ModelWithRouters(nn.Module):
    """The parts of the causal LM that ``post_load_weights`` reads: MoE blocks and the text model's dtype."""

    def __init__(self, blocks: int):
        super().__init__()
        self.blocks = nn.ModuleList()
        for _ in range(blocks):
            block = nn.Module()
            add_router_parameters(block, SimpleNamespace(num_experts=8, hidden_size=32, use_routing_bias=True))
            with torch.no_grad():
                block.gate.weight.uniform_(-1e-3, 1e-3)
            self.blocks.append(block)
        self.model = SimpleNamespace(dtype=torch.bfloat16)
        self.weights_loaded = False


def _load_format(monkeypatch, load_format):
    bag = SimpleNamespace(load_format=load_format)
    monkeypatch.setattr("sglang.srt.runtime_context.get_model", lambda: bag)


@pytest.mark.parametrize("load_format", ["dummy", SimpleNamespace(value="dummy")], ids=["string", "enum"])
def test_random_weights_round_the_routers_to_the_published_dtype(monkeypatch, load_format):
    _load_format(monkeypatch, load_format)
    assert weights_are_random()
    model = _ModelWithRouters(blocks=2)
    before = [block.gate.weight.detach().clone() for block in model.blocks]
    assert any(not torch.equal(w, w.to(PUBLISHED_ROUTER_DTYPE).float()) for w in before)
    MiniMaxM3SparseForCausalLM.post_load_weights(model)
    for block, original in zip(model.blocks, before):
        weight = block.gate.weight
        assert weight.dtype == torch.float32
        assert torch.equal(weight, original.to(PUBLISHED_ROUTER_DTYPE).float())
        assert block.gate_half is None  # parts are for CUDA weights only


def test_a_checkpoint_load_keeps_the_routers_fp32_values(monkeypatch):
    _load_format(monkeypatch, "auto")
    assert not weights_are_random()
    model = _ModelWithRouters(blocks=1)
    before = model.blocks[0].gate.weight.detach().clone()
    MiniMaxM3SparseForCausalLM.post_load_weights(model)
    assert torch.equal(model.blocks[0].gate.weight, before)


def test_outside_a_server_the_weights_count_as_loaded():
    """No runtime context is published when the model is built outside SGLang's runner."""
    assert minimax_m3.weights_are_random() is False


def test_an_update_after_the_dummy_fill_keeps_its_router_values(monkeypatch):
    """A trainer that starts the server on random weights and then sends its own (SGLang's
    update_weights_from_tensor -> load_weights -> post_load_weights) keeps their fp32 bits."""
    _load_format(monkeypatch, "dummy")
    model = _ModelWithRouters(blocks=1)
    MiniMaxM3SparseForCausalLM.post_load_weights(model)  # the dummy loader's call
    assert model.weights_loaded
    update = torch.full((8, 32), 1.0 + 2.0**-20)  # not a bf16 value
    model.blocks[0].gate.weight.data.copy_(update)
    MiniMaxM3SparseForCausalLM.post_load_weights(model)  # after the update's load_weights
    assert torch.equal(model.blocks[0].gate.weight, update)
