"""Where settings come from: text and vision never leak, the VL wrapper's text keys, SGLang's
padded object, overrides."""

from __future__ import annotations

import copy
import json

import pytest
from m3_config_layouts import shipped_text_config, vl_wrapper

from sglang_m3.config import M3ConfigError, M3TextSpec, checkpoint_config, text_part, vision_part
from sglang_m3.config import source


def test_text_reading_ignores_vision_config(shipped_top, tiny_spec):
    other = copy.deepcopy(shipped_top)
    other["vision_config"].update(hidden_size=999, intermediate_size=7, num_attention_heads=3, num_hidden_layers=11, head_dim=5)
    assert M3TextSpec.from_config(other) == M3TextSpec.from_config(shipped_top) == tiny_spec
    assert "vision_config" not in text_part(other) and text_part(other)["hidden_size"] == tiny_spec.hidden_size


def test_vision_part_is_the_vision_config_only(shipped_top):
    vision = vision_part(shipped_top)
    assert vision == shipped_top["vision_config"]
    assert vision_part(shipped_top["text_config"]) is None  # text-only layout


def test_text_field_missing_from_text_config_is_not_taken_from_the_wrapper(shipped_top):
    top = copy.deepcopy(shipped_top)
    top["num_hidden_layers"] = top["text_config"].pop("num_hidden_layers")
    with pytest.raises(M3ConfigError, match="num_hidden_layers"):
        M3TextSpec.from_config(top)


@pytest.mark.parametrize("tie", [True, False])
def test_top_level_tie_word_embeddings_fills_a_text_config_without_it(shipped_top, tie):
    top = copy.deepcopy(shipped_top)
    del top["text_config"]["tie_word_embeddings"]
    top["tie_word_embeddings"] = tie
    assert text_part(top)["tie_word_embeddings"] is tie
    assert M3TextSpec.from_config(top).tie_word_embeddings is tie


def test_text_config_tie_is_kept_when_the_wrapper_has_none(shipped_top):
    top = copy.deepcopy(shipped_top)
    del top["tie_word_embeddings"]
    top["text_config"]["tie_word_embeddings"] = True
    assert M3TextSpec.from_config(top).tie_word_embeddings is True


def test_text_config_that_is_not_a_mapping_is_refused(shipped_top):
    with pytest.raises(M3ConfigError, match="text_config"):
        M3TextSpec.from_config({**shipped_top, "text_config": "oops"})


def _transformers_object(top: dict):
    from transformers.models.minimax_m3_vl import MiniMaxM3VLConfig

    return MiniMaxM3VLConfig(**copy.deepcopy(top))


def test_object_fallback_restores_sglang_padded_values(tiny_spec):
    """Without a directory, the config object is read with SGLang's ``original_*`` values."""
    from sglang.srt.configs.update_config import update_config

    config = _transformers_object(vl_wrapper(shipped_text_config(tiny_spec)))
    for target in (config, config.text_config):  # what adjust_config_with_unaligned_cpu_tp does
        update_config(target, "original_intermediate_size", tiny_spec.moe_intermediate_size)
        update_config(target, "intermediate_size", tiny_spec.moe_intermediate_size + 16)
        update_config(target, "original_num_attention_heads", tiny_spec.num_heads)
        update_config(target, "original_total_num_kv_heads", tiny_spec.num_kv_heads)
    config.text_config.num_attention_heads = tiny_spec.num_heads * 2
    config.text_config.num_key_value_heads = tiny_spec.num_kv_heads * 2
    spec = M3TextSpec.from_config(config)
    assert spec.moe_intermediate_size == tiny_spec.moe_intermediate_size
    assert (spec.num_heads, spec.num_kv_heads) == (tiny_spec.num_heads, tiny_spec.num_kv_heads)
    # transformers' class drops the nested sparse form and rewrites hidden_act; what it keeps agrees
    assert spec.sparse_layers == tiny_spec.sparse_layers and spec.moe_layers == tiny_spec.moe_layers
    assert spec.hidden_act == "swigluoai"


def test_file_wins_over_a_padded_object(tiny_spec, tmp_path):
    top = vl_wrapper(shipped_text_config(tiny_spec))
    (tmp_path / "config.json").write_text(json.dumps(top))
    config = _transformers_object(top)
    config.text_config.intermediate_size = tiny_spec.moe_intermediate_size + 16
    assert M3TextSpec.from_config(config, str(tmp_path)) == tiny_spec


def test_overrides_merge_into_sub_configs_and_rope_and_replace_other_keys(monkeypatch, shipped_top, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(shipped_top))
    overrides = {
        "text_config": {"routed_scaling_factor": 3.0, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "rope_theta": 10000.0},
        "vision_config": {"hidden_size": 48},
        "projector_hidden_size": 12,
    }
    monkeypatch.setattr(source, "_server_overrides", lambda: copy.deepcopy(overrides))
    top = checkpoint_config(None, str(tmp_path))
    assert top["vision_config"]["intermediate_size"] == shipped_top["vision_config"]["intermediate_size"]
    assert top["vision_config"]["hidden_size"] == 48 and top["projector_hidden_size"] == 12
    spec = M3TextSpec.from_config(None, str(tmp_path))
    assert spec.routed_scaling_factor == 3.0 and spec.rope_theta == 10000.0
    assert spec.num_layers == shipped_top["text_config"]["num_hidden_layers"]


def test_override_that_breaks_a_field_is_refused_naming_it(monkeypatch, shipped_top, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(shipped_top))
    monkeypatch.setattr(source, "_server_overrides", lambda: {"text_config": {"qk_norm_type": "per_layer"}})
    with pytest.raises(M3ConfigError, match="qk_norm_type.*per_head"):
        M3TextSpec.from_config(None, str(tmp_path))


def test_mxfp8_quantization_config_in_text_config_is_read(shipped_top):
    top = copy.deepcopy(shipped_top)
    top["text_config"]["quantization_config"] = {"quant_method": "mxfp8", "modules_to_not_convert": ["lm_head"]}
    assert M3TextSpec.from_config(top).quantization.ignored_modules == ("lm_head",)


def test_other_quantization_config_in_text_config_is_refused(shipped_top):
    top = copy.deepcopy(shipped_top)
    top["text_config"]["quantization_config"] = {"quant_method": "awq"}
    with pytest.raises(M3ConfigError, match=r"quantization_config\.quant_method' is 'awq'"):
        M3TextSpec.from_config(top)
