"""The shared expert in the fused layer's extra slot (``sglang_m3.models.fused_moe``), on the CPU.

SGLang's fused MoE layer itself needs CUDA (its served behaviour is covered by
``tests/gpu/test_fused_shared_expert_gpu.py``); what the plugin adds around it is plain torch and
runs here against the separate layout: checkpoint names reach the slot as the right shard, and
the dense GEMMs over the slot's weights equal the separate ``GatedMLP`` on the same weights,
also when SGLang has interleaved the slot's gate/up rows for its fused epilogue.
"""

from __future__ import annotations

import types

import pytest
import torch


def _fused_like(shared_slot: int, w13: torch.Tensor, w2: torch.Tensor, spec, interleaved: bool = False):
    """Just enough of an ``M3FusedMoeBlock`` for its shared-expert methods: the fused layer's weights."""
    from sglang_m3.models.fused_activation import GatedActivation

    experts = types.SimpleNamespace(w13_weight=w13, w2_weight=w2, quant_method=types.SimpleNamespace(w13_swiglu_interleaved=interleaved))
    return types.SimpleNamespace(shared_slot=shared_slot, experts=experts, shared_experts=None,
                                 shared_act=GatedActivation(spec.hidden_act, spec.swiglu_alpha, spec.swiglu_limit))


@pytest.mark.parametrize("interleaved", [False, True])
def test_dense_gemms_over_the_slot_equal_the_separate_mlp(tiny_spec, single_rank, interleaved):
    from sglang_m3.models.fused_moe import M3FusedMoeBlock
    from sglang_m3.models.moe import GatedMLP

    torch.manual_seed(0)
    h, inter, e = tiny_spec.hidden_size, tiny_spec.moe_intermediate_size, tiny_spec.num_experts
    mlp = GatedMLP(tiny_spec, inter, reduce_results=False)
    with torch.no_grad():
        for param in mlp.parameters():
            param.copy_(torch.randn_like(param) / param.shape[-1] ** 0.5)
    w13 = torch.randn(e + 1, 2 * inter, h)
    w2 = torch.randn(e + 1, h, inter)
    gate_up = mlp.gate_up_proj.weight.detach()
    if interleaved:  # SGLang's layout: gate row i, then up row i
        gate_up = torch.stack(gate_up.chunk(2), dim=1).flatten(0, 1)
    w13[e], w2[e] = gate_up, mlp.down_proj.weight.detach()
    x = torch.randn(9, h) * 2  # gates beyond the swiglu-oai clamp too
    got = M3FusedMoeBlock.shared_expert(_fused_like(e, w13, w2, tiny_spec, interleaved), x)
    torch.testing.assert_close(got, mlp(x), rtol=1e-5, atol=1e-5)


def test_shared_checkpoint_tensors_reach_the_slot_as_their_shards():
    from sglang_m3.models.fused_moe import M3FusedMoeBlock

    calls = []
    block = types.SimpleNamespace(shared_slot=128, load_expert_weight=lambda *args: calls.append(args))
    tensors = {name: torch.full((2, 2), float(i)) for i, name in enumerate(("gate", "up", "down"))}
    for name, tensor in tensors.items():
        M3FusedMoeBlock.load_shared_weight(block, name, tensor)
    assert [(expert, which) for expert, which, _ in calls] == [(128, "w1"), (128, "w3"), (128, "w2")]
    assert all(t is tensors[name] for (_, _, t), name in zip(calls, tensors))


def test_the_loader_hands_shared_tensors_to_a_block_that_holds_them():
    """Checkpoint names of the shared expert go to ``load_shared_weight`` where the block holds the
    shared expert in its fused layer, and to the separate MLP's parameters otherwise."""
    from sglang_m3.models import minimax_m3

    loader = minimax_m3.TextWeightLoader.__new__(minimax_m3.TextWeightLoader)
    received = []
    holder = types.SimpleNamespace(shared_slot=4, load_shared_weight=lambda which, tensor: received.append((which, tensor)))
    loader.model = types.SimpleNamespace(get_submodule=lambda name: holder if name == "model.layers.3.mlp" else None)
    weight = torch.ones(3)
    for projection in ("gate", "up", "down"):
        loader._copy(f"model.layers.3.block_sparse_moe.shared_experts.{projection}_proj.weight", weight)
    assert [which for which, _ in received] == ["gate", "up", "down"]
    separate = []
    holder.shared_slot = None
    param = types.SimpleNamespace(weight_loader=lambda p, value, shard: separate.append(shard))
    loader.params = {"model.layers.3.mlp.shared_experts.gate_up_proj.weight": param}
    loader._copy("model.layers.3.block_sparse_moe.shared_experts.up_proj.weight", weight)
    assert separate == [1] and len(received) == 3
