"""The tiny checkpoint's two config.json layouts: the right keys each, one model for both readers."""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from sglang_m3.config import M3TextSpec
from sglang_m3.models.vision import VisionDims

HF_ONLY_TEXT_KEYS = {"layer_types", "mlp_layer_types", "rope_parameters", "index_n_heads", "index_head_dim", "index_block_size", "index_topk_blocks", "index_local_blocks"}
SHIPPED_ONLY_TEXT_KEYS = {"moe_layer_freq", "sparse_attention_config", "rope_theta", "partial_rotary_factor", "n_shared_experts", "use_qk_norm", "use_gemma_norm", "use_routing_bias", "scoring_func", "swiglu_beta", "num_mtp_modules"}


def config_of(model_dir: str) -> dict:
    with open(f"{model_dir}/config.json", encoding="utf-8") as handle:
        return json.load(handle)


@pytest.mark.parametrize("vision", [False, True], ids=["text", "vl"])
def test_shipped_layout_has_the_shipped_keys_only(tiny_checkpoint_factory, vision):
    config = config_of(tiny_checkpoint_factory(vision=vision))
    text = config["text_config"]
    assert SHIPPED_ONLY_TEXT_KEYS <= set(text) and not HF_ONLY_TEXT_KEYS & set(text)
    assert text["hidden_act"] == "swigluoai" and text["qk_norm_type"] == "per_head"
    assert text["rotary_dim"] == 16 and text["partial_rotary_factor"] == 0.5
    assert set(text["sparse_attention_config"]) >= {"sparse_attention_freq", "sparse_disable_index_value", "sparse_init_block"}
    assert config["vision_config"]["model_type"] == "clip_vision_model"


@pytest.mark.parametrize("vision", [False, True], ids=["text", "vl"])
def test_hf_layout_is_what_transformers_writes(tiny_checkpoint_factory, vision):
    text = config_of(tiny_checkpoint_factory(vision=vision, layout="hf"))["text_config"]
    assert HF_ONLY_TEXT_KEYS <= set(text) and not {"moe_layer_freq", "sparse_attention_config"} & set(text)
    assert text["model_type"] == "minimax_m3_vl_text"


def test_both_layouts_read_as_one_model_by_sglang_m3_and_transformers(tiny_checkpoint_factory):
    from transformers import AutoConfig

    shipped, hf = tiny_checkpoint_factory(vision=True), tiny_checkpoint_factory(vision=True, layout="hf")
    assert M3TextSpec.from_config(None, shipped) == M3TextSpec.from_config(None, hf)
    ours, theirs = AutoConfig.from_pretrained(shipped).text_config, AutoConfig.from_pretrained(hf).text_config
    for key in ("layer_types", "mlp_layer_types", "rope_parameters", "rotary_dim", "index_n_heads", "index_head_dim", "index_block_size", "index_topk_blocks", "index_local_blocks", "intermediate_size", "shared_intermediate_size"):
        assert getattr(ours, key) == getattr(theirs, key), key
    with safe_open(f"{shipped}/model.safetensors", "pt") as a, safe_open(f"{hf}/model.safetensors", "pt") as b:
        assert set(a.keys()) == set(b.keys())
        assert all(a.get_tensor(k).equal(b.get_tensor(k)) for k in a.keys())


def test_vision_sizes_differ_from_the_text_sizes(tiny_checkpoint_factory):
    model_dir = tiny_checkpoint_factory(vision=True)
    vision = VisionDims.from_config(config_of(model_dir))
    text = M3TextSpec.from_config(None, model_dir)
    assert vision.hidden_size not in (text.hidden_size, 1280)
    assert vision.intermediate_size not in (text.moe_intermediate_size, text.dense_intermediate_size, text.shared_intermediate_size, 5120)
    assert vision.num_heads not in (text.num_heads, text.num_kv_heads, 16)
    assert vision.num_layers not in (text.num_layers, 32)
    assert vision.text_hidden_size == text.hidden_size


def test_mtp_modules_are_written_under_the_shipped_names(tiny_checkpoint_factory):
    model_dir = tiny_checkpoint_factory(vision=True, mtp_modules=1)
    text = config_of(model_dir)["text_config"]
    assert text["num_mtp_modules"] == 1 and text["num_nextn_predict_layers"] == 1
    with safe_open(f"{model_dir}/model.safetensors", "pt") as handle:
        assert any(k.startswith("language_model.model.mtp.layers.0.") for k in handle.keys())
    with pytest.raises(ValueError, match="shipped layout only"):
        tiny_checkpoint_factory(vision=True, layout="hf", mtp_modules=1)
