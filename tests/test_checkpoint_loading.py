"""Weight loading: a missing, misshapen or foreign tensor is an error that names it."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from torch import nn

from sglang_m3.config import M3TextSpec
from sglang_m3.models.checkpoint_layout import CheckpointError, expected_text_tensors
from sglang_m3.models.minimax_m3 import TextWeightLoader


class ShapeOnlyModel(nn.Module):
    """Carries a spec and no parameters: exercises the loader's checks, not the copies."""

    def __init__(self, spec):
        super().__init__()
        self.spec = spec


class RecordingLoader(TextWeightLoader):
    def _copy(self, name, tensor):
        self.copied.append(name)


def checkpoint_tensors(model_dir):
    with safe_open(f"{model_dir}/model.safetensors", "pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}


def loader_for(model_dir):
    from transformers import AutoConfig

    spec = M3TextSpec.from_config(AutoConfig.from_pretrained(model_dir), model_dir)
    loader = RecordingLoader(ShapeOnlyModel(spec))
    loader.copied = []
    return loader


def test_every_checkpoint_tensor_is_expected_and_complete(tiny_m3_checkpoint):
    loader = loader_for(tiny_m3_checkpoint)
    tensors = checkpoint_tensors(tiny_m3_checkpoint)
    loader.load(tensors.items())
    assert len(loader.copied) == len(expected_text_tensors(loader.spec)) == len(tensors)


def test_missing_tensor_is_named(tiny_m3_checkpoint):
    loader = loader_for(tiny_m3_checkpoint)
    tensors = checkpoint_tensors(tiny_m3_checkpoint)
    del tensors["language_model.model.layers.2.self_attn.index_k_proj.weight"]
    with pytest.raises(CheckpointError, match=r"missing 1 tensor\(s\): model\.layers\.2\.self_attn\.index_k_proj\.weight"):
        loader.load(tensors.items())


def test_misshapen_tensor_is_named(tiny_m3_checkpoint):
    loader = loader_for(tiny_m3_checkpoint)
    name = "language_model.model.layers.3.block_sparse_moe.experts.5.w2.weight"
    with pytest.raises(CheckpointError, match=rf"{name.replace('.', '[.]')}' has shape \(3, 3\)"):
        loader.load_one(name, torch.zeros(3, 3))


def test_foreign_tensor_is_named(tiny_m3_checkpoint):
    loader = loader_for(tiny_m3_checkpoint)
    with pytest.raises(CheckpointError, match="layers.9.self_attn.q_proj.weight"):
        loader.load_one("language_model.model.layers.9.self_attn.q_proj.weight", torch.zeros(1))


def test_mtp_modules_are_skipped(tiny_m3_checkpoint):
    loader = loader_for(tiny_m3_checkpoint)
    loader.load_one("mtp.0.eh_proj.weight", torch.zeros(2, 2))
    assert loader.copied == []


def test_dense_mlp_accepts_both_spellings(tiny_m3_checkpoint):
    loader = loader_for(tiny_m3_checkpoint)
    shape = expected_text_tensors(loader.spec)["model.layers.0.mlp.gate_proj.weight"]
    loader.load_one("language_model.model.layers.0.block_sparse_moe.gate_proj.weight", torch.zeros(shape))
    loader.load_one("model.layers.0.mlp.up_proj.weight", torch.zeros(shape))
    assert loader.copied == ["model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"]
