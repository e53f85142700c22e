"""Weight loading: a missing, misshapen or foreign tensor is an error that names it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from torch import nn

from sglang_m3.config import M3TextSpec
from sglang_m3.models.checkpoint_layout import CheckpointError, expected_text_tensors
from sglang_m3.models.minimax_m3 import TextWeightLoader

from names_only_loader import whole_model_stage
from sglang_m3.models.pipeline import PipelineStage


class ShapeOnlyModel(nn.Module):
    """Carries a spec and no parameters: exercises the loader's checks, not the copies.
    ``stage``: the text model's pipeline stage (default: one stage, every layer)."""

    def __init__(self, spec, stage=None):
        super().__init__()
        self.spec = spec
        self.model = stage or whole_model_stage(spec)


class RecordingLoader(TextWeightLoader):
    def _copy(self, name, tensor):
        self.copied.append(name)


def checkpoint_tensors(model_dir):
    with safe_open(f"{model_dir}/model.safetensors", "pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}


def loader_for(model_dir, stage=None):
    from transformers import AutoConfig

    spec = M3TextSpec.from_config(AutoConfig.from_pretrained(model_dir), model_dir)
    loader = RecordingLoader(ShapeOnlyModel(spec, stage))
    loader.copied = []
    return loader


def test_every_checkpoint_tensor_is_expected_and_complete(tiny_m3_checkpoint):
    loader = loader_for(tiny_m3_checkpoint)
    tensors = checkpoint_tensors(tiny_m3_checkpoint)
    loader.load(tensors.items())
    assert len(loader.copied) == len(expected_text_tensors(loader.spec)) == len(tensors)


def _stage(rank: int, layers: range):
    return SimpleNamespace(stage=PipelineStage(rank=rank, size=2), start_layer=layers.start, end_layer=layers.stop)


@pytest.mark.parametrize("rank,layers", [(0, range(0, 2)), (1, range(2, 4))])
def test_a_pipeline_stage_loads_its_own_tensors_only(tiny_m3_checkpoint, rank, layers):
    """Under ``--pp-size 2`` each stage copies its layers' tensors, the first the embedding, the
    last the final norm and head; the other stage's are passed over, and only its own may be missing."""
    loader = loader_for(tiny_m3_checkpoint, _stage(rank, layers))
    tensors = checkpoint_tensors(tiny_m3_checkpoint)
    other = next(name for name in tensors if f"layers.{layers.start - 1 if rank else layers.stop}." in name)
    loader.load((name, t) for name, t in tensors.items() if name != other)
    own_layers = {int(name.split("layers.")[1].split(".")[0]) for name in loader.copied if "layers." in name}
    assert own_layers == set(layers)
    assert ("model.embed_tokens.weight" in loader.copied) == (rank == 0)
    assert ("model.norm.weight" in loader.copied) == ("lm_head.weight" in loader.copied) == (rank == 1)
    mine = next(name for name in tensors if f"layers.{layers.start}." in name)
    with pytest.raises(CheckpointError, match=r"missing 1 tensor"):
        loader_for(tiny_m3_checkpoint, _stage(rank, layers)).load((n, t) for n, t in tensors.items() if n != mine)


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
