"""Checkpoint loading as real checkpoints arrive: sharded, in other dtypes, streamed by iterators
whose tensors live only until the next is drawn, with a weight stored twice or one missing.

The model classes are built outside a server (SGLang's parallel layers as rank 0 of 1, the logits
processor stubbed: it reads server settings and plays no part in loading) and fed the tiny
checkpoints' tensors, as SGLang's loader feeds ``load_weights``.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from fused_attn_cases import as_rank
from names_only_loader import NamesOnlyLoader
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

import sglang_m3.models.minimax_m3 as minimax_m3
from sglang_m3.config import M3TextSpec
from sglang_m3.models.checkpoint_layout import CheckpointError
from sglang_m3.models.minimax_m3 import MiniMaxM3SparseForCausalLM
from sglang_m3.models.minimax_m3_vl import MiniMaxM3SparseForConditionalGeneration

LAYER = "language_model.model.layers."
GATE = LAYER + "1.block_sparse_moe.gate.weight"


def read_tensors(model_dir: str) -> dict[str, torch.Tensor]:
    with safe_open(f"{model_dir}/model.safetensors", "pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}


def build(model_class, model_dir: str, dtype=torch.float32) -> nn.Module:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # SGLang's loader builds the model under the model's dtype
    try:
        with pytest.MonkeyPatch.context() as patch, as_rank():
            patch.setattr(minimax_m3, "LogitsProcessor", lambda config: nn.Identity())
            return model_class(config)
    finally:
        torch.set_default_dtype(previous)


def loaded(model: nn.Module, weights) -> dict[str, torch.Tensor]:
    with as_rank(), torch.no_grad():
        model.load_weights(weights)
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


@pytest.fixture(scope="module")
def text_dir(tiny_m3_checkpoint):
    return tiny_m3_checkpoint


@pytest.fixture(scope="module")
def vl_dir(tiny_m3_vl_checkpoint):
    return tiny_m3_vl_checkpoint


CLASSES = {"text": (MiniMaxM3SparseForCausalLM, "text_dir"), "vl": (MiniMaxM3SparseForConditionalGeneration, "vl_dir")}


@pytest.fixture(scope="module", params=sorted(CLASSES))
def reference(request):
    """(model class, checkpoint dir, its tensors, the state after a plain load)."""
    model_class, fixture = CLASSES[request.param]
    model_dir = request.getfixturevalue(fixture)
    tensors = read_tensors(model_dir)
    return model_class, model_dir, tensors, loaded(build(model_class, model_dir), tensors.items())


def assert_same_state(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    differ = [name for name in want if not torch.equal(got[name], want[name])]
    assert not differ, f"{len(differ)} of {len(want)} differ, e.g. {differ[:3]}"


def test_each_tensor_is_copied_before_the_next_is_drawn(reference):
    """SGLang's fastsafetensors iterator frees a file's buffer once its tensors are yielded, and
    without mmap every yielded tensor is host memory: a loader that holds tensors back (the VL class
    kept every text tensor until the vision tower had seen the whole stream) loads freed memory or
    holds the whole model in RAM. Here a tensor turns to NaN as soon as the next one is drawn."""
    model_class, model_dir, tensors, want = reference

    def short_lived():
        for name, tensor in tensors.items():
            buffer = tensor.clone()
            yield name, buffer
            buffer.fill_(float("nan"))

    assert_same_state(loaded(build(model_class, model_dir), short_lived()), want)


def _write_shards(tensors: dict, directory, shards: int = 3) -> list[str]:
    """The tensors over ``shards`` files, names dealt out of order, with the index a sharded
    checkpoint ships; returns the files SGLang's loader would read, in its order."""
    from sglang.srt.model_loader.weight_utils import filter_duplicate_safetensors_files

    files = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    weight_map = {name: files[(i * 7) % shards] for i, name in enumerate(sorted(tensors))}
    for file in files:
        save_file({n: t for n, t in tensors.items() if weight_map[n] == file}, os.path.join(directory, file), metadata={"format": "pt"})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w", encoding="utf-8") as handle:
        json.dump({"metadata": {}, "weight_map": weight_map}, handle)
    found = sorted(os.path.join(directory, file) for file in os.listdir(directory) if file.endswith(".safetensors"))
    return filter_duplicate_safetensors_files(found, str(directory), "model.safetensors.index.json")


def test_sharded_checkpoint_loads_as_the_single_file(reference, tmp_path):
    from sglang.srt.model_loader.weight_utils import buffered_multi_thread_safetensors_weights_iterator

    model_class, model_dir, tensors, want = reference
    files = _write_shards(tensors, tmp_path)
    assert len(files) == 3
    got = loaded(build(model_class, model_dir), buffered_multi_thread_safetensors_weights_iterator(files, max_workers=2))
    assert_same_state(got, want)


@pytest.mark.parametrize("model_dtype", [torch.bfloat16, torch.float32], ids=["bf16-model", "fp32-model"])
@pytest.mark.parametrize("checkpoint_dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_other_checkpoint_dtypes_are_converted_and_the_router_keeps_fp32(text_dir, model_dtype, checkpoint_dtype):
    tensors = {name: t.to(checkpoint_dtype) for name, t in read_tensors(text_dir).items()}
    model = build(MiniMaxM3SparseForCausalLM, text_dir, model_dtype)
    loaded(model, tensors.items())
    block = model.model.layers[1].mlp
    assert block.gate.weight.dtype == torch.float32
    assert torch.equal(block.gate.weight, tensors[GATE].float())  # all the checkpoint's bits, even in a bf16 model
    assert torch.equal(model.model.embed_tokens.weight, tensors["language_model.model.embed_tokens.weight"].to(model_dtype))
    w2 = tensors[LAYER + "2.block_sparse_moe.experts.3.w2.weight"]
    assert torch.equal(model.model.layers[2].mlp.w2[3], w2.to(model_dtype))


@pytest.mark.parametrize(
    "missing, named",
    [
        (LAYER + "3.block_sparse_moe.experts.5.w2.weight", "model.layers.3.block_sparse_moe.experts.5.w2.weight"),
        ("language_model.lm_head.weight", "lm_head.weight"),  # tie_word_embeddings is false
    ],
    ids=["expert-w2", "lm-head"],
)
def test_missing_text_tensor_is_named(reference, missing, named):
    model_class, model_dir, tensors, _ = reference
    with pytest.raises(CheckpointError, match=rf"missing 1 tensor\(s\): {named.replace('.', '[.]')}$"):
        loaded(build(model_class, model_dir), [(n, t) for n, t in tensors.items() if n != missing])


def test_missing_vision_tensor_is_named(vl_dir):
    tensors = read_tensors(vl_dir)
    name = "vision_tower.vision_model.encoder.layers.1.self_attn.q_proj.weight"
    assert name in tensors
    with pytest.raises(ValueError, match=rf"missing vision tensor {name.replace('.', '[.]')}"):
        loaded(build(MiniMaxM3SparseForConditionalGeneration, vl_dir), [(n, t) for n, t in tensors.items() if n != name])


@pytest.mark.parametrize(
    "first, second",
    [
        (LAYER + "0.mlp.gate_proj.weight", LAYER + "0.block_sparse_moe.gate_proj.weight"),
        (LAYER + "2.block_sparse_moe.experts.1.w1.weight", LAYER + "2.block_sparse_moe.experts.1.w1.weight"),
    ],
    ids=["dense-mlp-both-spellings", "same-name-twice"],
)
def test_a_weight_stored_twice_is_refused(text_dir, first, second):
    """Two tensors for one parameter: the later one would replace the earlier without a word."""
    spec = M3TextSpec.from_config(None, text_dir)
    tensors = read_tensors(text_dir)
    value = tensors.get(first, tensors.get(second))
    loader = NamesOnlyLoader(spec)
    loader.load_one(first, value)
    with pytest.raises(CheckpointError, match=rf"'{second.replace('.', '[.]')}' loads into .* already loaded"):
        loader.load_one(second, value)


@pytest.mark.parametrize("model_kind", sorted(CLASSES))
def test_an_update_after_a_load_may_bring_some_tensors(model_kind, request):
    """SGLang's weight updates (update_weights_from_tensor and the like) call load_weights with
    the tensors that changed: after a load, names and shapes are still checked, completeness not."""
    model_class, fixture = CLASSES[model_kind]
    model_dir = request.getfixturevalue(fixture)
    tensors = read_tensors(model_dir)
    name = next(key for key in tensors if key.endswith("layers.1.block_sparse_moe.gate.weight"))
    fresh = torch.randn_like(tensors[name])
    with pytest.raises((CheckpointError, ValueError), match="missing"):  # the vision tower's is a ValueError
        loaded(build(model_class, model_dir), [(name, fresh)])  # a first load must be whole
    model = build(model_class, model_dir)
    before = loaded(model, tensors.items())
    after = loaded(model, [(name, fresh)])
    changed = [key for key in before if not torch.equal(before[key], after[key])]
    assert changed == ["model.layers.1.mlp.gate.weight"]  # the router; nothing else moved
    assert torch.equal(after[changed[0]], fresh.float())
    with pytest.raises(CheckpointError, match="not part of"):
        loaded(model, [(name.replace("gate.weight", "gate.bias"), fresh[:, 0])])


@pytest.mark.parametrize("model_kind", sorted(CLASSES))
def test_rotary_buffers_saved_by_other_tools_are_skipped(model_kind, request, caplog):
    """Some tools save the rotary tables (``rotary_emb.inv_freq``) beside the weights; the model
    computes them from the config, so such a checkpoint loads as one without them."""
    import logging

    model_class, fixture = CLASSES[model_kind]
    model_dir = request.getfixturevalue(fixture)
    tensors = read_tensors(model_dir)
    prefix = "language_model." if model_kind == "vl" else ""
    buffers = {
        f"{prefix}model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(16),
        "vision_tower.vision_model.encoder.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8),
    }
    with caplog.at_level(logging.INFO, logger=minimax_m3.__name__):
        got = loaded(build(model_class, model_dir), list(tensors.items()) + list(buffers.items()))
    assert_same_state(got, loaded(build(model_class, model_dir), tensors.items()))
    assert "skipped 2 rotary buffer(s)" in caplog.text


@pytest.mark.parametrize("model_kind", sorted(CLASSES))
def test_a_tied_checkpoint_may_keep_the_output_layer_copy(model_kind, request, tmp_path, caplog):
    """With ``tie_word_embeddings`` the output layer is the embedding; a checkpoint that still
    stores ``lm_head.weight`` (some exporters keep it) loads as one without it, the copy unread."""
    import logging
    import shutil

    model_class, fixture = CLASSES[model_kind]
    tied_dir = shutil.copytree(request.getfixturevalue(fixture), tmp_path / "tied")
    config_path = tied_dir / "config.json"
    config = json.loads(config_path.read_text())
    for part in (config, config.get("text_config") or {}):  # the shipped layout carries it at both levels
        part["tie_word_embeddings"] = True
    config_path.write_text(json.dumps(config))
    tensors = read_tensors(str(tied_dir))
    head = next(key for key in tensors if key.endswith("lm_head.weight"))
    stray = tensors.pop(head)
    embedding = next(value for key, value in tensors.items() if key.endswith("model.embed_tokens.weight"))
    assert not torch.equal(stray, embedding)  # a copy that disagrees cannot slip in unnoticed below
    with caplog.at_level(logging.INFO, logger=minimax_m3.__name__):
        got = loaded(build(model_class, str(tied_dir)), list(tensors.items()) + [(head, stray)])
    assert_same_state(got, loaded(build(model_class, str(tied_dir)), tensors.items()))
    model = build(model_class, str(tied_dir))
    loaded(model, tensors.items())
    assert model.lm_head is model.model.embed_tokens
    assert "skipped lm_head.weight: tie_word_embeddings is true" in caplog.text


@pytest.mark.parametrize("dtype", [torch.int64, torch.int8, torch.bool])
def test_an_integer_weight_is_refused_by_name(text_dir, dtype):
    """Loading casts a tensor to its parameter's dtype, so integers stored for a weight (a broken
    export) would load as garbage: the tensor is refused, named, before anything is copied."""
    tensors = read_tensors(text_dir)
    name = LAYER.replace("language_model.", "") + "0.self_attn.o_proj.weight"
    name = name if name in tensors else "language_model." + name
    tensors[name] = tensors[name].to(dtype)
    with pytest.raises(CheckpointError, match=rf"'{name.replace('.', '[.]')}' is {dtype}"):
        loaded(build(MiniMaxM3SparseForCausalLM, text_dir), tensors.items())


def test_an_integer_vision_weight_is_refused_by_name(vl_dir):
    tensors = read_tensors(vl_dir)
    name = next(key for key in tensors if key.startswith("vision_tower.") and key.endswith("fc1.weight"))
    tensors[name] = tensors[name].to(torch.int32)
    with pytest.raises(ValueError, match=rf"{name.replace('.', '[.]')}: torch.int32, expected a floating-point weight"):
        loaded(build(MiniMaxM3SparseForConditionalGeneration, vl_dir), tensors.items())


def test_a_missing_dense_mlp_tensor_is_named_as_the_checkpoint_spells_it(reference):
    """transformers saves a dense layer's MLP under ``block_sparse_moe.``; the loader takes it
    under ``mlp.`` too. A missing one was named only as ``mlp.``, a name such a checkpoint never holds."""
    model_class, model_dir, tensors, _ = reference
    missing = LAYER + "0.block_sparse_moe.gate_proj.weight"
    assert missing in tensors
    with pytest.raises(CheckpointError, match=r"missing 1 tensor\(s\): ") as error:
        loaded(build(model_class, model_dir), [(n, t) for n, t in tensors.items() if n != missing])
    assert "model.layers.0.block_sparse_moe.gate_proj.weight" in str(error.value)
    assert "model.layers.0.mlp.gate_proj.weight" in str(error.value)


VISION_FC1 = "vision_tower.vision_model.encoder.layers.1.block_sparse_moe.fc1.weight"


def test_a_missing_vision_mlp_tensor_is_named_as_the_checkpoint_spells_it(vl_dir):
    tensors = read_tensors(vl_dir)
    assert VISION_FC1 in tensors
    with pytest.raises(ValueError, match="missing vision tensor") as error:
        loaded(build(MiniMaxM3SparseForConditionalGeneration, vl_dir), [(n, t) for n, t in tensors.items() if n != VISION_FC1])
    assert VISION_FC1 in str(error.value)


@pytest.mark.parametrize("broken", ["shape", "dtype"])
def test_a_broken_vision_tensor_is_reported_once(vl_dir, broken):
    """A misshapen or integer tensor is named with what is wrong with it, and not also reported
    missing (under another spelling of its name)."""
    tensors = read_tensors(vl_dir)
    tensors[VISION_FC1] = torch.zeros(3, 3) if broken == "shape" else tensors[VISION_FC1].to(torch.int32)
    with pytest.raises(ValueError) as error:
        loaded(build(MiniMaxM3SparseForConditionalGeneration, vl_dir), tensors.items())
    problems = str(error.value).splitlines()[1:]
    assert len(problems) == 1 and problems[0].strip().startswith(f"{VISION_FC1}: "), problems


def test_an_index_naming_a_missing_shard_is_refused_by_file(text_dir, tmp_path):
    """SGLang's own file selection refuses it, naming the shard, before any tensor reaches the
    model (without that, the loader would name the tensors the shard held)."""
    from sglang.srt.model_loader.weight_utils import filter_duplicate_safetensors_files

    tensors = read_tensors(text_dir)
    files = _write_shards(tensors, tmp_path)
    os.remove(files[1])
    present = sorted(str(path) for path in tmp_path.glob("*.safetensors"))
    with pytest.raises(RuntimeError, match=rf"missing from .*{os.path.basename(files[1])}"):
        filter_duplicate_safetensors_files(present, str(tmp_path), "model.safetensors.index.json")


def test_a_vision_weight_stored_twice_is_refused(vl_dir):
    """As for the text model: a vision MLP weight under both spellings the loader accepts, or one
    name twice, would have the later copy replace the earlier without a word."""
    tensors = read_tensors(vl_dir)
    other_spelling = VISION_FC1.replace(".block_sparse_moe.", ".mlp.")
    stream = list(tensors.items()) + [(other_spelling, torch.zeros_like(tensors[VISION_FC1]))]
    with pytest.raises(ValueError, match=rf"{other_spelling.replace('.', '[.]')}: a second tensor for one weight"):
        loaded(build(MiniMaxM3SparseForConditionalGeneration, vl_dir), stream)
