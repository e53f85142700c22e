"""Checkpoint names as shipped: MTP modules skipped with one info line, quantized tensors refused
when config.json declares no quantization (MXFP8 checkpoints: tests/quant)."""

from __future__ import annotations

import logging

import pytest
import torch
from names_only_loader import NamesOnlyLoader
from safetensors import safe_open

from sglang_m3.models.checkpoint_layout import CheckpointError


@pytest.fixture
def checkpoint_tensors(tiny_m3_checkpoint):
    with safe_open(f"{tiny_m3_checkpoint}/model.safetensors", "pt") as handle:
        return [(name, handle.get_tensor(name)) for name in handle.keys() if ".mtp." not in name and not name.startswith("mtp.")]


def test_mtp_tensors_are_skipped_with_one_info_line(tiny_spec, checkpoint_tensors, caplog):
    mtp = [
        ("model.mtp.layers.0.eh_proj.weight", torch.zeros(4, 8)),
        ("model.mtp.layers.0.enorm.weight", torch.zeros(8)),
        ("language_model.model.mtp.layers.1.self_attn.q_proj.weight", torch.zeros(4, 8)),
        ("model.mtp.layers.6.block_sparse_moe.experts.0.w1.weight_scale_inv", torch.zeros(1)),
    ]
    weights = checkpoint_tensors[:3] + mtp + checkpoint_tensors[3:]
    with caplog.at_level(logging.INFO, logger="sglang_m3.models.minimax_m3"):
        NamesOnlyLoader(tiny_spec).load(weights)
    lines = [r for r in caplog.records if r.name == "sglang_m3.models.minimax_m3" and "mtp" in r.getMessage().lower()]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    assert lines[0].levelno == logging.INFO and "skipped 4 " in lines[0].getMessage()


def test_no_mtp_line_without_mtp_tensors(tiny_spec, checkpoint_tensors, caplog):
    with caplog.at_level(logging.INFO, logger="sglang_m3.models.minimax_m3"):
        NamesOnlyLoader(tiny_spec).load(checkpoint_tensors)
    assert not [r for r in caplog.records if "mtp" in r.getMessage().lower()]


@pytest.mark.parametrize(
    "suffix, fmt",
    [(".weight_scale_inv", "block-wise FP8"), (".weight_scale", "FP8/INT scaled weights"), (".input_scale", "FP8 static")],
)
@pytest.mark.parametrize(
    "stem",
    ["language_model.model.layers.1.self_attn.q_proj", "model.layers.2.block_sparse_moe.experts.3.w1"],
)
def test_quantized_scale_tensor_is_refused_by_name(tiny_spec, stem, suffix, fmt):
    name = stem + suffix
    with pytest.raises(CheckpointError) as refused:
        NamesOnlyLoader(tiny_spec).load_one(name, torch.ones(2, 2))
    message = str(refused.value)
    assert f"'{name}'" in message and fmt in message and "declares no quantization_config" in message
    assert "shape" not in message


def test_quantized_weights_before_their_scales_are_refused_by_the_scale(tiny_spec, checkpoint_tensors):
    """An FP8 weight (right shape, other dtype) followed by its scale: the scale names the format."""
    loader = NamesOnlyLoader(tiny_spec)
    name, tensor = next((n, t) for n, t in checkpoint_tensors if n.endswith("q_proj.weight"))
    loader.load_one(name, tensor)
    with pytest.raises(CheckpointError, match="block-wise FP8.*declares no quantization_config"):
        loader.load_one(name + "_scale_inv", torch.ones(1, 1))


def test_fp8_weight_in_an_unquantized_checkpoint_is_refused_not_cast(tiny_spec, checkpoint_tensors):
    name, tensor = next((n, t) for n, t in checkpoint_tensors if n.endswith("q_proj.weight"))
    with pytest.raises(CheckpointError, match=rf"'{name}'.*float8_e4m3fn.*declares no quantization_config"):
        NamesOnlyLoader(tiny_spec).load_one(name, tensor.to(torch.float8_e4m3fn))
