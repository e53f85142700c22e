"""The torch MoE block's parallel layout: for every ``--tp-size`` / ``--ep-size`` split, the
ranks' partial outputs sum to the single-rank block (what the server's all-reduce forms), each
expert is held by exactly one expert group, and a rank's expert shapes are SGLang's FusedMoE ones.

Ranks are built in one process under scoped overrides of SGLang's parallel context (no process
groups); float64 weights make the comparison one of summation order only.
"""

from __future__ import annotations

import types

import pytest
import torch

LAYOUTS = [(2, 1), (2, 2), (4, 2), (4, 4)]  # (tp, ep): moe_tp = tp / ep ranks per expert group


def _rank(tp: int, ep: int, rank: int, moe_dp: int = 1):
    """The parallel context of ``rank`` as SGLang derives it (runtime_context.derive_spawn_ranks)."""
    from sglang.srt.runtime_context import get_parallel

    moe_tp = tp // (ep * moe_dp)
    group = types.SimpleNamespace(world_size=tp, rank_in_group=rank)
    return get_parallel().override(
        tp_group=group, tp_size=tp, tp_rank=rank, moe_dp_size=moe_dp,
        moe_ep_size=ep, moe_ep_rank=rank % (tp // moe_dp) // moe_tp, moe_tp_size=moe_tp, moe_tp_rank=rank % moe_tp,
    )


def _checkpoint(spec, seed: int) -> dict[str, torch.Tensor]:
    """Full (unsharded) float64 MoE tensors of one layer, named as ``load_expert_weight`` takes them."""
    gen = torch.Generator().manual_seed(seed)
    e, h, inter, shared = spec.num_experts, spec.hidden_size, spec.moe_intermediate_size, spec.shared_intermediate_size

    def draw(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64) / shape[-1] ** 0.5

    tensors = {"gate": draw(e, h), "bias": torch.linspace(-0.3, 0.3, e, dtype=torch.float64)}
    tensors.update({f"{i}.{w}": draw(inter, h) for i in range(e) for w in ("w1", "w3")})
    tensors.update({f"{i}.w2": draw(h, inter) for i in range(e)})
    tensors.update(shared_gate=draw(shared, h), shared_up=draw(shared, h), shared_down=draw(h, shared))
    return tensors


def _block(spec, tensors, tp: int = 1, ep: int = 1, rank: int = 0):
    """One rank's block, built and loaded under that rank's context (loaders slice by it)."""
    from sglang_m3.models.moe import M3SparseMoeBlock

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with _rank(tp, ep, rank), torch.no_grad():
            block = M3SparseMoeBlock(spec)
            block.gate.weight.copy_(tensors["gate"])
            block.e_score_correction_bias.copy_(tensors["bias"])
            for i in range(spec.num_experts):
                for which in ("w1", "w3", "w2"):
                    block.load_expert_weight(i, which, tensors[f"{i}.{which}"])
            shared = block.shared_experts
            shared.gate_up_proj.weight_loader(shared.gate_up_proj.weight, tensors["shared_gate"], 0)
            shared.gate_up_proj.weight_loader(shared.gate_up_proj.weight, tensors["shared_up"], 1)
            shared.down_proj.weight_loader(shared.down_proj.weight, tensors["shared_down"])
    finally:
        torch.set_default_dtype(previous)
    return block


@pytest.mark.parametrize("experts_path", ["loop", "static"])
@pytest.mark.parametrize("tp, ep", LAYOUTS)
def test_rank_partials_sum_to_the_single_rank_block(tiny_spec, single_rank, tp, ep, experts_path):
    tensors = _checkpoint(tiny_spec, seed=tp * 10 + ep)
    x = torch.randn(29, tiny_spec.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(5)) * 2
    whole = _block(tiny_spec, tensors)
    whole.experts_path = experts_path
    expected = whole.partial_forward(x)
    total = torch.zeros_like(expected)
    for rank in range(tp):
        block = _block(tiny_spec, tensors, tp, ep, rank)
        block.experts_path = experts_path
        with _rank(tp, ep, rank):
            total += block.partial_forward(x)
    diff = (total - expected).abs().max().item()
    assert diff <= 1e-12 * expected.abs().max().item(), f"tp {tp} ep {ep}: ranks sum to within {diff:.2e} only"


@pytest.mark.parametrize("tp, ep", LAYOUTS)
def test_each_expert_lives_in_one_group_at_fused_moe_shapes(tiny_spec, tp, ep):
    tensors = _checkpoint(tiny_spec, seed=0)
    e, h, inter = tiny_spec.num_experts, tiny_spec.hidden_size, tiny_spec.moe_intermediate_size
    holders: dict[int, list[int]] = {}
    for rank in range(tp):
        block = _block(tiny_spec, tensors, tp, ep, rank)
        moe_tp, moe_tp_rank = tp // ep, rank % (tp // ep)
        assert tuple(block.w13.shape) == (e // ep, 2 * inter // moe_tp, h)
        assert tuple(block.w2.shape) == (e // ep, h, inter // moe_tp)
        for local, expert in enumerate(block.local_experts):
            holders.setdefault(expert, []).append(rank)
            rows = slice(moe_tp_rank * inter // moe_tp, (moe_tp_rank + 1) * inter // moe_tp)
            assert torch.equal(block.w13[local, : inter // moe_tp], tensors[f"{expert}.w1"][rows])
            assert torch.equal(block.w2[local], tensors[f"{expert}.w2"][:, rows])
    # every expert on exactly tp / ep ranks (its group), each holding a different slice
    assert holders == {i: list(range((i // (e // ep)) * (tp // ep), (i // (e // ep) + 1) * (tp // ep))) for i in range(e)}


def test_layouts_the_block_cannot_serve_are_refused_naming_the_flag(tiny_spec):
    from sglang_m3.models.moe import M3SparseMoeBlock

    with _rank(3, 3, 0), pytest.raises(ValueError, match=r"num_local_experts \(8\) is not divisible by --ep-size \(3\)"):
        M3SparseMoeBlock(tiny_spec)
    with _rank(2, 1, 0, moe_dp=2), pytest.raises(ValueError, match="--moe-dp-size"):
        M3SparseMoeBlock(tiny_spec)


def test_inspect_builds_ranks_at_the_served_expert_shapes(tiny_m3_checkpoint):
    """``sglang-m3 inspect`` builds ranks inside SGLang's own runtime contexts: under TP2 + EP2 each
    rank holds 4 whole experts (the shapes the server allocates), not 8 half-width ones."""
    import json
    import os

    from sglang_m3.inspect.meta_build import layout

    with open(os.path.join(tiny_m3_checkpoint, "config.json"), encoding="utf-8") as handle:
        top = json.load(handle)
    with layout(top, 2, 2) as build:
        params = {p.name: p.shape for p in build(1).params}
    assert params["model.layers.1.mlp.w13"] == (4, 128, 128)
    assert params["model.layers.1.mlp.w2"] == (4, 128, 64)
