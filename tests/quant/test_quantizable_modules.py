"""Which checkpoint modules count as SGLang's quantizable M3 linears: the text model's only.

The vision tower's ``vision_tower.vision_model.encoder.layers.N.self_attn.q_proj`` and the MTP
modules' ``model.mtp.layers.N.self_attn.q_proj`` end like a text layer's projection; matched as
one, the MXFP8 writer quantized the vision tower (its 48-wide tiny projections made
``tiny-checkpoint --vision --mxfp8`` fail, real widths would have written e4m3 vision weights
that SGLang builds unquantized).
"""

from __future__ import annotations

import pytest

from sglang_m3.quant.checkpoint_writer import quantized_module
from sglang_m3.quant.loading import QUANTIZABLE


@pytest.mark.parametrize(
    "module",
    [
        "model.layers.0.self_attn.q_proj",
        "language_model.model.layers.3.self_attn.index_k_proj",
        "language_model.model.layers.0.mlp.down_proj",
        "model.layers.0.block_sparse_moe.gate_proj",
        "language_model.model.layers.3.block_sparse_moe.shared_experts.up_proj",
        "model.layers.3.block_sparse_moe.experts.127.w2",
    ],
)
def test_text_linears_are_quantizable(module):
    assert QUANTIZABLE.search(module)


@pytest.mark.parametrize(
    "module",
    [
        "vision_tower.vision_model.encoder.layers.0.self_attn.q_proj",
        "vision_tower.vision_model.encoder.layers.0.self_attn.out_proj",
        "vision_tower.vision_model.encoder.layers.0.mlp.fc1",
        "model.mtp.layers.0.self_attn.q_proj",
        "language_model.model.layers.3.block_sparse_moe.gate",
        "language_model.model.layers.0.self_attn.q_norm",
    ],
)
def test_vision_mtp_and_unquantized_text_modules_are_not(module):
    assert not QUANTIZABLE.search(module)
    assert quantized_module(module + ".weight") is None


def test_the_writer_keeps_the_vision_tower_plain_and_lists_it(tmp_path):
    import json

    from safetensors import safe_open

    from sglang_m3.tiny.checkpoint import build_tiny_checkpoint

    directory = build_tiny_checkpoint(str(tmp_path / "vl"), vision=True, quantization="mxfp8")
    with safe_open(f"{directory}/model.safetensors", "pt") as handle:
        scaled = {name.removesuffix("_scale_inv") for name in handle.keys() if name.endswith("_scale_inv")}
        vision = [name for name in handle.keys() if name.startswith("vision_tower.")]
        assert vision and not any(handle.get_tensor(name).element_size() == 1 for name in vision)
    assert scaled and all(name.startswith("language_model.model.layers.") for name in scaled)
    with open(f"{directory}/config.json", encoding="utf-8") as handle:
        assert "vision_tower" in json.load(handle)["quantization_config"]["modules_to_not_convert"]
