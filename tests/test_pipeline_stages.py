"""The M3 classes built as one pipeline stage of two (``--pp-size 2``), without a server: what each
stage holds, and the draft interfaces a pipeline cannot serve. Served PP2 is checked against TP1 and
transformers in tests/e2e/test_tensor_parallel_cpu.py and tests/multimodal/test_e2e_vision_server.py."""

from __future__ import annotations

import types

import pytest
from fused_attn_cases import as_rank
from sglang.srt.layers.utils import PPMissingLayer
from torch import nn
from transformers import AutoConfig

import sglang_m3.models.minimax_m3 as minimax_m3
from sglang_m3.models.minimax_m3 import MiniMaxM3SparseForCausalLM
from sglang_m3.models.minimax_m3_vl import MiniMaxM3SparseForConditionalGeneration


def build_stage(model_class, checkpoint: str, rank: int, monkeypatch):
    """``model_class`` as pipeline rank ``rank`` of 2 (SGLang's group stated in the runtime context)."""
    from sglang.srt.runtime_context import get_parallel

    monkeypatch.setattr(minimax_m3, "LogitsProcessor", lambda config: nn.Identity())
    group = types.SimpleNamespace(rank_in_group=rank, world_size=2)
    with as_rank(), get_parallel().override(pp_group=group):
        return model_class(AutoConfig.from_pretrained(checkpoint))


@pytest.mark.parametrize("rank", [0, 1])
def test_each_stage_builds_its_half(tiny_m3_vl_checkpoint, rank, monkeypatch):
    model = build_stage(MiniMaxM3SparseForConditionalGeneration, tiny_m3_vl_checkpoint, rank, monkeypatch)
    layers = model.model.layers
    built = [i for i, layer in enumerate(layers) if not isinstance(layer, PPMissingLayer)]
    assert built == list(range(model.start_layer, model.end_layer)) == ([0, 1] if rank == 0 else [2, 3])
    assert isinstance(model.model.embed_tokens, PPMissingLayer) == (rank == 1)
    assert isinstance(model.model.norm, PPMissingLayer) == isinstance(model.lm_head, PPMissingLayer) == (rank == 0)
    assert (model.vision is None) == (rank == 1)  # media are embedded on the first stage only


@pytest.mark.parametrize("rank", [0, 1])
def test_drafts_are_refused_under_pipeline_parallelism(tiny_m3_checkpoint, rank, monkeypatch):
    model = build_stage(MiniMaxM3SparseForCausalLM, tiny_m3_checkpoint, rank, monkeypatch)
    with pytest.raises(ValueError, match=r"--pp-size 2\).*--pp-size 1"):
        model.set_eagle3_layers_to_capture()
    with pytest.raises(ValueError, match=r"--pp-size 2\).*--pp-size 1"):
        model.get_embed_and_head()
