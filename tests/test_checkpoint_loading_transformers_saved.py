"""Checkpoints written by transformers itself (``save_pretrained`` of the model and of its
processor), config.json rewritten into the shipped layout, with a vision tower unlike the text
model in every size: hidden 40 (text 96), 5 heads (6), 3 layers (5), MLP 72 (experts 48, dense
80), patch 8 (the shipped 14). Loaded through ``load_weights`` and served, against transformers.

Regressions, each once a refused start:
- transformers 5 saves the processor as ``processor_config.json`` only, and an image processor
  saved alone writes ``preprocessor_config.json`` in its own form; SGLang 0.5.23 reads M3's
  processor from that file in the published form only (``OSError`` / ``KeyError: 'height'``);
- ``save_processor`` wrote processor files of patch 14 for a tower of patch 8;
- a checkpoint declaring itself text-only (``language_model_only``) under the VL architecture
  name, as transformers names it, was asked for its vision tensors ("missing vision tensor").
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from server_harness import launch_cpu_server
from test_checkpoint_loading_edge_cases import assert_same_state, build, loaded, read_tensors
from transformers_oracle import load_reference_model, random_prompt

from sglang_m3.config import M3TextSpec, checkpoint_config
from sglang_m3.models.minimax_m3 import MiniMaxM3SparseForCausalLM
from sglang_m3.models.minimax_m3_vl import MiniMaxM3SparseForConditionalGeneration
from sglang_m3.models.vision import VisionDims
from sglang_m3.plugin import HOOKS
from sglang_m3.tiny.checkpoint import save_processor, transformers_processor
from tests.e2e.served_vs_reference import assert_matches_reference
from tests.e2e.transformers_saved import rewrite_in_shipped_layout, save_transformers_model
from tests.multimodal.test_e2e_vision_server import IMAGE_A, generate, oracle_tokens, processed, served_tokens
from tests.multimodal.test_vision_tower import reference_rows

VISION = {"hidden_size": 40, "num_attention_heads": 5, "num_hidden_layers": 3, "intermediate_size": 72, "patch_size": 8}
PROCESSOR_TARGET = "sglang.srt.utils.hf_transformers.processor._get_minimax_m31_processor"


def transformers_saved(directory: str, dtype=torch.float32, **save_options) -> str:
    """The model and its processor saved by transformers, config.json in the shipped layout."""
    save_transformers_model(directory, VISION, dtype=dtype, **save_options)
    rewrite_in_shipped_layout(directory)
    transformers_processor(directory).save_pretrained(directory)
    return directory


def text_only(model_dir: str, directory) -> str:
    """A copy of ``model_dir`` without the vision tower's tensors, declaring itself text-only
    (``language_model_only``) under the VL architecture name transformers saved it with."""
    from safetensors.torch import load_file, save_file

    copy = shutil.copytree(model_dir, directory)
    tensors = load_file(copy / "model.safetensors")
    save_file({n: t for n, t in tensors.items() if n.startswith("language_model.")}, copy / "model.safetensors", metadata={"format": "pt"})
    config = _config(str(copy))
    assert config["architectures"] == ["MiniMaxM3SparseForConditionalGeneration"]
    (copy / "config.json").write_text(json.dumps({**config, "language_model_only": True}))
    return str(copy)


def _config(model_dir: str) -> dict:
    return checkpoint_config(None, model_dir, overrides={})


@pytest.fixture(scope="module")
def saved_dir(tmp_path_factory):
    return transformers_saved(str(tmp_path_factory.mktemp("transformers-saved-shipped")))


@pytest.fixture(scope="module")
def text_only_dir(saved_dir, tmp_path_factory):
    return text_only(saved_dir, tmp_path_factory.mktemp("text-only") / "checkpoint")


def test_vision_sizes_are_unlike_the_text_sizes(saved_dir):
    vision, text = VisionDims.from_config(_config(saved_dir)), M3TextSpec.from_config(None, saved_dir)
    assert (vision.hidden_size, vision.num_heads, vision.num_layers, vision.patch_size) == (40, 5, 3, 8)
    assert vision.hidden_size != text.hidden_size and vision.num_heads not in (text.num_heads, text.num_kv_heads)
    assert vision.num_layers != text.num_layers
    assert vision.intermediate_size not in (text.moe_intermediate_size, text.dense_intermediate_size, text.shared_intermediate_size)
    assert "processor_config.json" in os.listdir(saved_dir) and "preprocessor_config.json" not in os.listdir(saved_dir)


def _sglang_weight_stream(model_dir: str):
    """The checkpoint's tensors as SGLang's loader streams them (index-filtered files, threads)."""
    from sglang.srt.model_loader.weight_utils import buffered_multi_thread_safetensors_weights_iterator, filter_duplicate_safetensors_files

    files = sorted(os.path.join(model_dir, f) for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    files = filter_duplicate_safetensors_files(files, model_dir, "model.safetensors.index.json")
    return buffered_multi_thread_safetensors_weights_iterator(files, max_workers=2)


@pytest.mark.parametrize(
    "dtype, save_options",
    [(torch.float32, {}), (torch.bfloat16, {"max_shard_size": "100KB"})],
    ids=["fp32-one-file", "bf16-sharded"],
)
def test_loaded_model_matches_transformers(tmp_path, dtype, save_options):
    """Loaded through ``load_weights`` from SGLang's weight stream: the vision rows equal
    transformers' (the vision-tower test's tolerances) and the text weights are transformers'."""
    model_dir = transformers_saved(str(tmp_path), dtype, **save_options)
    sharded = "model.safetensors.index.json" in os.listdir(model_dir)
    assert sharded == bool(save_options) and sharded == (len([f for f in os.listdir(model_dir) if f.endswith(".safetensors")]) > 1)
    ours = build(MiniMaxM3SparseForConditionalGeneration, model_dir)
    state = loaded(ours, _sglang_weight_stream(model_dir))
    reference = load_reference_model(model_dir)
    assert torch.equal(state["model.embed_tokens.weight"], reference.model.language_model.embed_tokens.weight)
    assert torch.equal(state["lm_head.weight"], reference.lm_head.weight)
    grids = [[1, 4, 6], [2, 2, 4]]
    pixel_values = torch.randn(sum(t * h * w for t, h, w in grids), ours.vision.dims.patch_dim, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(ours.vision(pixel_values, torch.tensor(grids)), reference_rows(reference, pixel_values, grids), rtol=1e-4, atol=1e-5)


def _sglang_processor(model_dir: str, monkeypatch):
    """SGLang's ``get_processor`` for the checkpoint, the plugin's hook on the M3 processor loader applied."""
    import sglang.srt.utils.hf_transformers.processor as loader

    hooks = [hook.function for hook in HOOKS if hook.target == PROCESSOR_TARGET]
    assert hooks, f"no hook on {PROCESSOR_TARGET}: checkpoints with transformers' processor files do not start"
    original = loader._get_minimax_m31_processor
    monkeypatch.setattr(loader, "_get_minimax_m31_processor", lambda *args, **kwargs: hooks[0](original, *args, **kwargs))
    return loader.get_processor(model_dir, model_name=model_dir)


def _image_processor_saved_alone(model_dir: str, directory) -> str:
    """``model_dir`` with only transformers' image processor file (its own form of preprocessor_config.json)."""
    copy = shutil.copytree(model_dir, directory)
    os.remove(copy / "processor_config.json")
    transformers_processor(str(copy)).image_processor.save_pretrained(copy)
    return str(copy)


@pytest.mark.parametrize("form", ["processor_config", "image_processor_alone"])
def test_processor_files_saved_by_transformers_are_read_by_transformers(saved_dir, tmp_path, monkeypatch, form):
    model_dir = saved_dir if form == "processor_config" else _image_processor_saved_alone(saved_dir, tmp_path / "alone")
    processor = _sglang_processor(model_dir, monkeypatch)
    image = processor.image_processor
    assert (image.patch_size, image.merge_size, image.temporal_patch_size) == (8, 2, 2)
    assert processor.video_processor.patch_size == 8
    assert processor.tokenizer.convert_tokens_to_ids("]<]image[>[") == _config(model_dir)["image_token_index"]


def test_the_shipped_preprocessor_file_is_still_read_by_sglang(saved_dir, tmp_path, monkeypatch):
    """``save_processor`` writes the published form with the tower's patch size; SGLang's own
    reader of that form keeps reading it."""
    model_dir = shutil.copytree(saved_dir, tmp_path / "shipped-form")
    save_processor(str(model_dir))
    processor = _sglang_processor(str(model_dir), monkeypatch)
    assert type(processor.image_processor).__name__ == "MiniMaxM31ImageProcessor"
    assert processor.image_processor.patch_size == processor.video_processor.patch_size == 8


@pytest.mark.parametrize("vision_tensors", [False, True], ids=["text-only-checkpoint", "whole-checkpoint"])
def test_language_model_only_loads_the_text_model_alone(saved_dir, text_only_dir, vision_tensors):
    """SGLang's switch for a multimodal checkpoint served as text only (the checkpoint's own
    ``language_model_only``, or ``--language-model-only``, both written onto the config): the VL
    class loads the text model alone, as the text class does, vision tensors present or not."""
    tensors = read_tensors(saved_dir if vision_tensors else text_only_dir)
    assert any(n.startswith("vision_tower.") for n in tensors) == vision_tensors
    want = loaded(build(MiniMaxM3SparseForCausalLM, text_only_dir), read_tensors(text_only_dir).items())
    assert_same_state(loaded(build(MiniMaxM3SparseForConditionalGeneration, text_only_dir), tensors.items()), want)


@pytest.mark.server
def test_served_text_and_image_match_transformers(saved_dir, server_log_dir):
    with launch_cpu_server(saved_dir, server_log_dir) as server:
        assert_matches_reference(server, saved_dir, random_prompt(97, 97), "transformers-saved shipped p97")
        prompt = "Describe ]<]image[>[ briefly."
        inputs = processed(saved_dir, prompt, [IMAGE_A])
        result = generate(server, prompt, [IMAGE_A])
    assert result["meta_info"]["prompt_tokens"] == inputs["input_ids"].shape[1]
    assert served_tokens(result) == oracle_tokens(saved_dir, inputs)


@pytest.mark.server
def test_served_text_only_checkpoint_of_the_vl_architecture_matches_transformers(text_only_dir, server_log_dir):
    with launch_cpu_server(text_only_dir, server_log_dir) as server:
        assert_matches_reference(server, text_only_dir, random_prompt(97, 97), "transformers-saved text-only VL p97")
