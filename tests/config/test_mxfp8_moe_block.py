"""The MXFP8 MoE block (CUDA's block for MXFP8 checkpoints) on the CPU, kernels interpreted.

Built at the tiny checkpoint's shapes and loaded from quantized expert tensors, for every
``--tp-size`` / ``--ep-size`` split its ranks' partial outputs sum to the torch loop block loaded
with the dequantized weights (fp32) on one rank. Tolerance: the kernels' bf16 roundings
(``tests/kernels/test_mxfp8_moe.py``) plus the bf16 shared expert; measured relative Frobenius
error 2.7e-3..3.3e-3, asserted <= 1e-2 (a wrong slice, scale group or expert is O(1)).
"""

from __future__ import annotations

import types

import pytest
import torch
from interpreter_only import INTERPRETER_ONLY

from sglang_m3.models.checkpoint_layout import CheckpointError
from sglang_m3.quant.loading import MXFP8Weight
from sglang_m3.quant.mxfp8 import dequantize, quantize

pytestmark = INTERPRETER_ONLY

LAYOUTS = [(1, 1), (2, 1), (2, 2), (4, 2), (4, 4)]  # (tp, ep); tiny intermediate 64 -> 32 per rank at most split


def _rank(tp: int, ep: int, rank: int):
    """The parallel context of ``rank`` as SGLang derives it (see test_moe_expert_parallel)."""
    from sglang.srt.runtime_context import get_parallel

    moe_tp = tp // ep
    group = types.SimpleNamespace(world_size=tp, rank_in_group=rank)
    return get_parallel().override(
        tp_group=group, tp_size=tp, tp_rank=rank, moe_dp_size=1,
        moe_ep_size=ep, moe_ep_rank=rank // moe_tp, moe_tp_size=moe_tp, moe_tp_rank=rank % moe_tp,
    )


def _checkpoint(spec, seed: int) -> dict:
    """One MoE layer's checkpoint: MXFP8 expert pairs, bf16-valued router/shared weights."""
    gen = torch.Generator().manual_seed(seed)
    e, h, inter, shared = spec.num_experts, spec.hidden_size, spec.moe_intermediate_size, spec.shared_intermediate_size

    def draw(*shape):
        return (torch.randn(*shape, generator=gen) / shape[-1] ** 0.5).to(torch.bfloat16).float()

    tensors = {"gate": draw(e, h), "bias": torch.linspace(-0.3, 0.3, e)}
    for i in range(e):
        for which, shape in (("w1", (inter, h)), ("w3", (inter, h)), ("w2", (h, inter))):
            tensors[f"{i}.{which}"] = MXFP8Weight(*quantize(draw(*shape) * 3))
    tensors.update(shared_gate=draw(shared, h), shared_up=draw(shared, h), shared_down=draw(h, shared))
    return tensors


def _load_common(block, tensors, dtype):
    block.gate.weight.copy_(tensors["gate"])
    block.e_score_correction_bias.copy_(tensors["bias"])
    shared = block.shared_experts
    shared.gate_up_proj.weight_loader(shared.gate_up_proj.weight, tensors["shared_gate"].to(dtype), 0)
    shared.gate_up_proj.weight_loader(shared.gate_up_proj.weight, tensors["shared_up"].to(dtype), 1)
    shared.down_proj.weight_loader(shared.down_proj.weight, tensors["shared_down"].to(dtype))


def _mxfp8_block(spec, tensors, tp=1, ep=1, rank=0):
    from sglang_m3.models.mxfp8_moe import M3Mxfp8MoeBlock

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with _rank(tp, ep, rank), torch.no_grad():
            block = M3Mxfp8MoeBlock(spec, layer_id=1, prefix="model.layers.1.mlp")
            _load_common(block, tensors, torch.bfloat16)
            for i in range(spec.num_experts):
                for which in ("w1", "w3", "w2"):
                    block.load_expert_weight(i, which, tensors[f"{i}.{which}"])
    finally:
        torch.set_default_dtype(previous)
    return block


def _dequantized_loop_block(spec, tensors):
    from sglang_m3.models.moe import M3SparseMoeBlock

    with _rank(1, 1, 0), torch.no_grad():
        block = M3SparseMoeBlock(spec)
        _load_common(block, tensors, torch.float32)
        for i in range(spec.num_experts):
            for which in ("w1", "w3", "w2"):
                pair = tensors[f"{i}.{which}"]
                block.load_expert_weight(i, which, dequantize(pair.elements, pair.scales))
    return block


@pytest.mark.parametrize("tp, ep", LAYOUTS)
def test_rank_partials_match_the_dequantized_loop_block(tiny_spec, tp, ep):
    tensors = _checkpoint(tiny_spec, seed=tp * 10 + ep)
    x = (torch.randn(13, tiny_spec.hidden_size, generator=torch.Generator().manual_seed(tp + ep)) * 2).to(torch.bfloat16)
    with _rank(1, 1, 0), torch.no_grad():
        expected = _dequantized_loop_block(tiny_spec, tensors).partial_forward(x.float())
    total = torch.zeros_like(expected)
    for rank in range(tp):
        block = _mxfp8_block(tiny_spec, tensors, tp, ep, rank)
        assert block.w13.dtype == torch.float8_e4m3fn and block.w13_scale.dtype == torch.uint8
        with _rank(tp, ep, rank), torch.no_grad():
            part = block.partial_forward(x)
        assert part.dtype == torch.bfloat16 and torch.isfinite(part).all()
        total += part.float()
    rel = ((total - expected).norm() / expected.norm()).item()
    assert rel <= 1e-2, f"tp {tp} ep {ep}: relative error {rel:.3e}"


def test_each_rank_holds_its_slices_with_their_scales(tiny_spec):
    """TP4 + EP2: 4 experts per group, intermediate rows/columns 32 wide, scales sliced with them."""
    tensors = _checkpoint(tiny_spec, seed=0)
    inter = tiny_spec.moe_intermediate_size
    for rank in range(4):
        block = _mxfp8_block(tiny_spec, tensors, 4, 2, rank)
        rows = slice((rank % 2) * 32, (rank % 2) * 32 + 32)
        assert tuple(block.w13.shape) == (4, 64, tiny_spec.hidden_size)
        assert tuple(block.w2_scale.shape) == (4, tiny_spec.hidden_size, 1)
        for local, expert in enumerate(block.local_experts):
            w1, w3, w2 = (tensors[f"{expert}.{w}"] for w in ("w1", "w3", "w2"))
            assert torch.equal(block.w13[local, :32].view(torch.uint8), w1.elements[rows].view(torch.uint8))
            assert torch.equal(block.w13_scale[local, 32:], w3.scales[rows])
            assert torch.equal(block.w2[local].view(torch.uint8), w2.elements[:, rows].view(torch.uint8))
            assert torch.equal(block.w2_scale[local], w2.scales[:, rows.start // 32 : rows.stop // 32])
        assert block.local_experts == range((rank // 2) * 4, (rank // 2) * 4 + 4)
    assert inter == 64


def test_refuses_an_intermediate_slice_that_splits_a_scale_group(tiny_spec):
    from sglang_m3.models.mxfp8_moe import M3Mxfp8MoeBlock

    with _rank(4, 1, 0), pytest.raises(ValueError, match=r"intermediate_size \(64\).* 16 per rank, not a multiple of .*32"):
        M3Mxfp8MoeBlock(tiny_spec, layer_id=1)


def test_refuses_a_plain_expert_weight_by_name(tiny_spec):
    block = _mxfp8_block(tiny_spec, _checkpoint(tiny_spec, seed=1))
    with pytest.raises(CheckpointError, match=r"'model.layers.1.mlp.experts.3.w2.weight' arrived as a plain"):
        block.load_expert_weight(3, "w2", torch.zeros(tiny_spec.hidden_size, tiny_spec.moe_intermediate_size))


def test_forward_reads_nothing_on_the_host(tiny_spec, monkeypatch):
    """No ``.tolist()``/``.item()``/``bool(tensor)``/``torch.unique`` in the block's forward: what
    CUDA graph capture needs (the interpreter itself runs on numpy, not through these)."""
    block = _mxfp8_block(tiny_spec, _checkpoint(tiny_spec, seed=2))
    x = torch.randn(5, tiny_spec.hidden_size).to(torch.bfloat16)

    def refuse(*args, **kwargs):
        raise AssertionError("host read in the MXFP8 MoE block")

    monkeypatch.setattr(torch.Tensor, "tolist", refuse)
    monkeypatch.setattr(torch.Tensor, "item", refuse)
    monkeypatch.setattr(torch.Tensor, "__bool__", refuse)
    monkeypatch.setattr(torch, "unique", refuse)
    with _rank(1, 1, 0), torch.no_grad():
        block.partial_forward(x)
