"""The MXFP8 ignore list (``modules_to_not_convert`` / ``ignored_layers``) matches every spelling
SGLang 0.5.23 matches for an MXFP8 checkpoint, and nothing SGLang would quantize by accident.

SGLang's own matcher is the oracle: ``Fp8Config.from_config`` (the config SGLang builds for
``quant_method`` "mxfp8"), the M3 model's ``hf_to_sglang_mapper`` applied to the list as SGLang's
loader applies it, then ``is_layer_skipped`` on the prefix SGLang gives the module.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from sglang_m3.config import M3ConfigError, MXFP8Config
from sglang_m3.config.quantization import read_quantization
from sglang_m3.models.checkpoint_layout import CheckpointError
from sglang_m3.quant.loading import MXFP8Dequantizer
from sglang_m3.quant.mxfp8 import quantize

O_PROJ = "model.layers.0.self_attn.o_proj"
Q_PROJ = "model.layers.0.self_attn.q_proj"
SHARED_DOWN = "model.layers.1.block_sparse_moe.shared_experts.down_proj"
EXPERTS = "model.layers.1.block_sparse_moe.experts"
DENSE_GATE = "model.layers.0.mlp.gate_proj"
DENSE_GATE_SAVED = "model.layers.0.block_sparse_moe.gate_proj"  # transformers' save of a dense MLP

#: checkpoint module (text-only spelling, as the plugin asks) -> the prefix SGLang's M3 asks with
MODULES = {
    O_PROJ: "model.layers.0.self_attn.o_proj",
    Q_PROJ: "model.layers.0.self_attn.q_proj",
    DENSE_GATE: "model.layers.0.mlp.gate_proj",
    DENSE_GATE_SAVED: "model.layers.0.mlp.gate_proj",
    "model.layers.1.block_sparse_moe.gate": "model.layers.1.mlp.gate",
    SHARED_DOWN: "model.layers.1.mlp.shared_experts.down_proj",
    EXPERTS: "model.layers.1.mlp.experts",
    "model.layers.10.self_attn.o_proj": "model.layers.10.self_attn.o_proj",
    "model.embed_tokens": "model.embed_tokens",
    "lm_head": "lm_head",
}

#: one entry per spelling -> the modules of ``MODULES`` it leaves unquantized
SPELLINGS = {
    "exact name": (O_PROJ, {O_PROJ}),
    "without model.": ("layers.0.self_attn.o_proj", {O_PROJ}),
    "with language_model.": ("language_model.model.layers.0.self_attn.o_proj", {O_PROJ}),
    "parent module": ("model.layers.0", {O_PROJ, Q_PROJ, DENSE_GATE, DENSE_GATE_SAVED}),
    "parent with a trailing dot": ("model.layers.1.", {"model.layers.1.block_sparse_moe.gate", SHARED_DOWN, EXPERTS}),
    "dotted suffix": ("self_attn.o_proj", {O_PROJ, "model.layers.10.self_attn.o_proj"}),
    "last segment": ("o_proj", {O_PROJ, "model.layers.10.self_attn.o_proj"}),
    "middle segment": ("self_attn", {O_PROJ, Q_PROJ, "model.layers.10.self_attn.o_proj"}),
    "SGLang's mlp for block_sparse_moe": ("model.layers.1.mlp.shared_experts", {SHARED_DOWN}),
    "router by SGLang's name": ("mlp.gate", {"model.layers.1.block_sparse_moe.gate"}),
    "dense MLP in transformers' spelling": (DENSE_GATE_SAVED, {DENSE_GATE, DENSE_GATE_SAVED}),
    "one routed expert": ("model.layers.1.block_sparse_moe.experts.3.w2", {EXPERTS}),
    "lm_head": ("lm_head", {"lm_head"}),
    "embeddings with model.": ("model.embed_tokens", {"model.embed_tokens"}),
}


@pytest.fixture(scope="module")
def sglang_skips():
    """``sglang_skips(entries, prefix)``: SGLang 0.5.23's answer for an MXFP8 checkpoint."""
    from sglang.srt.layers.quantization.fp8 import Fp8Config
    from sglang.srt.layers.quantization.utils import is_layer_skipped
    from sglang.srt.models.minimax_m3 import MiniMaxM3SparseForCausalLM

    def skips(entries, prefix):
        quant = {"quant_method": "mxfp8", "activation_scheme": "dynamic", "modules_to_not_convert": list(entries)}
        config = Fp8Config.from_config(quant)
        config.apply_weight_name_mapper(MiniMaxM3SparseForCausalLM.hf_to_sglang_mapper)
        return is_layer_skipped(prefix, config.ignored_layers, fused_mapping=config.packed_modules_mapping)

    return skips


def _config(*entries):
    return read_quantization({"quantization_config": {"quant_method": "mxfp8", "modules_to_not_convert": list(entries)}})


@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
def test_each_spelling_ignores_what_sglang_skips_and_only_that(spelling, sglang_skips):
    entry, ignored = SPELLINGS[spelling]
    config = _config(entry)
    expected = {module for module, prefix in MODULES.items() if sglang_skips([entry], prefix)}
    if entry.startswith("language_model."):  # SGLang's text model has no language_model. root; its VL model has
        expected = {module for module, prefix in MODULES.items() if sglang_skips([entry], "language_model." + prefix)}
    assert expected == ignored, "the table disagrees with SGLang"
    assert {module for module in MODULES if config.ignores(module)} == ignored
    assert {module for module in MODULES if config.ignores("language_model." + module)} == ignored


def test_block_sparse_moe_and_mlp_are_one_spelling_for_a_dense_mlp_too(sglang_skips):
    """SGLang maps ``.block_sparse_moe.`` to ``.mlp.`` in every entry; a dense MLP is saved under
    either name (original checkpoints ``mlp.``, transformers ``block_sparse_moe.``)."""
    assert sglang_skips(["layers.0.block_sparse_moe.down_proj"], "model.layers.0.mlp.down_proj")
    assert _config("layers.0.block_sparse_moe.down_proj").ignores("model.layers.0.mlp.down_proj")
    assert _config("layers.0.mlp.down_proj").ignores("language_model.model.layers.0.block_sparse_moe.down_proj")


@pytest.mark.parametrize(
    "entry, module",
    [
        ("mlp.gate", "model.layers.0.mlp.gate_proj"),  # SGLang's own example: not a part of a segment
        ("layers.1", "model.layers.10.self_attn.o_proj"),
        ("experts.1", "model.layers.1.block_sparse_moe.experts.10.w1"),
        ("o_proj", Q_PROJ),
        ("model.layers.1.block_sparse_moe.experts.3.w2", "model.layers.1.block_sparse_moe.experts.4.w2"),
        ("model.layers.2.block_sparse_moe.experts.3.w2", EXPERTS),
        ("re:.*self_attn\\.o_proj$", Q_PROJ),
    ],
)
def test_a_module_no_entry_matches_stays_quantized(entry, module, sglang_skips):
    config = _config(entry)
    assert not config.ignores(module) and not config.ignores("language_model." + module)
    if not entry.startswith("re:"):
        assert not sglang_skips([entry], module.replace(".block_sparse_moe.", ".mlp."))


@pytest.mark.parametrize(
    "entry, module",
    [
        ("re:.*self_attn\\.o_proj$", O_PROJ),
        ("re:model\\.layers\\.1\\.mlp\\.experts", EXPERTS + ".3.w2"),  # SGLang's spelling of the module
        ("re:model\\.layers\\.1\\.block_sparse_moe\\.shared", SHARED_DOWN),  # the checkpoint's
        ("re:language_model\\.model\\.layers\\.0\\.", O_PROJ),
        ("re:vision_tower\\.", "vision_tower.vision_model.encoder.layers.0.mlp.fc1"),
    ],
)
def test_a_regular_expression_entry_matches_from_the_start_of_either_spelling(entry, module):
    config = _config(entry)
    assert config.ignores(module) and config.ignoring_entry(module) == entry


@pytest.mark.parametrize(
    "entry, named",
    [
        ("re:model.layers.(", "is not a valid regular expression"),
        ("*lm_head*", "is a wildcard pattern"),
        ("model.layers.?.self_attn", "is a wildcard pattern"),
    ],
)
def test_an_entry_that_can_match_no_module_is_refused_naming_it(entry, named):
    with pytest.raises(M3ConfigError) as refused:
        read_quantization({"quantization_config": {"quant_method": "mxfp8", "ignored_layers": ["lm_head", entry]}})
    assert f"'quantization_config.ignored_layers' entry {entry!r} {named}" in str(refused.value)


def test_the_loader_follows_the_matched_spellings():
    """The spellings take effect where the ignore list is used: a pair for a matched module is
    refused naming the entry, the pair of a module no entry matches is dequantized."""
    config = _config("self_attn.o_proj", "model.layers.1.mlp.shared_experts")
    elements, scales = quantize(torch.randn(128, 64))
    for module, entry in ((O_PROJ, "self_attn.o_proj"), (SHARED_DOWN, "model.layers.1.mlp.shared_experts")):
        dequantizer = MXFP8Dequantizer(config)
        refused = rf"quantizes 'language_model\.{re.escape(module)}', .* lists as unquantized \(entry '{re.escape(entry)}'\)"
        with pytest.raises(CheckpointError, match=refused):
            dequantizer.push(f"language_model.{module}.weight", elements)
    dequantizer = MXFP8Dequantizer(config)
    assert dequantizer.push(f"language_model.{Q_PROJ}.weight", elements) is None
    name, values = dequantizer.push(f"language_model.{Q_PROJ}.weight_scale_inv", scales)
    assert name == f"language_model.{Q_PROJ}.weight" and values.dtype == torch.float32 and dequantizer.dequantized == 1


def test_one_ignored_expert_leaves_its_layers_experts_unquantized_as_in_sglang(tiny_spec_with_mxfp8):
    """SGLang builds a layer's routed experts as one fused module: listing one expert keeps the
    whole layer's experts unquantized there, so the CUDA block choice follows it here."""
    from sglang_m3.models.fused_moe import has_mxfp8_experts

    layer = tiny_spec_with_mxfp8.moe_layers.index(True)
    one = _config(f"model.layers.{layer}.block_sparse_moe.experts.0.w1")
    assert has_mxfp8_experts(tiny_spec_with_mxfp8, layer)
    assert not has_mxfp8_experts(dataclasses.replace(tiny_spec_with_mxfp8, quantization=one), layer)
    assert has_mxfp8_experts(dataclasses.replace(tiny_spec_with_mxfp8, quantization=one), layer + 1)


@pytest.fixture(scope="module")
def tiny_spec_with_mxfp8(tiny_m3_checkpoint):
    from sglang_m3.config import M3TextSpec

    spec = M3TextSpec.from_config(None, tiny_m3_checkpoint)
    assert spec.moe_layers.count(True) >= 2
    return dataclasses.replace(spec, quantization=MXFP8Config())


#: the quantization_config keys a checkpoint may give its ignore list under -> the key errors name
#: (given both, they must agree, and SGLang's ``Fp8Config`` reads ``ignored_layers`` first)
IGNORE_KEY_SPELLINGS = {
    ("ignored_layers",): "ignored_layers",
    ("modules_to_not_convert",): "modules_to_not_convert",
    ("ignored_layers", "modules_to_not_convert"): "ignored_layers",
}


@pytest.mark.parametrize("keys", sorted(IGNORE_KEY_SPELLINGS), ids="+".join)
def test_refusals_name_the_ignore_list_key_the_checkpoint_used(keys):
    """Every error about the ignore list names the key it was read from, not a fixed one: the
    user searches config.json for the key the message names."""
    from sglang_m3.quant.loading import VisionTensorCheck

    entries = ["self_attn.o_proj", "vision_tower"]
    config = read_quantization({"quantization_config": {"quant_method": "mxfp8", **dict.fromkeys(keys, entries)}})
    field = f"'quantization_config.{IGNORE_KEY_SPELLINGS[keys]}'"
    elements, _ = quantize(torch.randn(128, 64))
    with pytest.raises(CheckpointError, match=rf"quantizes '{O_PROJ}', which config field {field} lists as unquantized"):
        MXFP8Dequantizer(config).push(f"{O_PROJ}.weight", elements)
    with pytest.raises(CheckpointError, match=rf"served as MXFP8 \(it is not in {field}\)"):
        MXFP8Dequantizer(config, keeps_quantized=lambda module: True).push(f"{Q_PROJ}.weight", torch.randn(128, 64))
    vision = "vision_tower.vision_model.encoder.layers.0.self_attn.q_proj.weight"
    with pytest.raises(CheckpointError, match=rf"is torch.float8_e4m3fn, but config field {field} lists"):
        VisionTensorCheck(config).refuse_quantized(vision, elements)
    assert read_quantization({"quantization_config": config.to_json()}) == config
