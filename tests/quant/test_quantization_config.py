"""The config reader's quantization_config: MXFP8 read, every other scheme or key refused by name."""

from __future__ import annotations

import pytest

from sglang_m3.config import M3ConfigError, MXFP8Config
from sglang_m3.config.quantization import read_quantization

PUBLISHED_STYLE = {
    "quant_method": "mxfp8", "activation_scheme": "dynamic", "fmt": "e4m3", "scale_fmt": "ue8m0",
    "weight_block_size": [1, 32], "modules_to_not_convert": ["lm_head", "model.embed_tokens"],
    "kv_cache_quant_algo": None,
}


def _read(**changes):
    return read_quantization({"quantization_config": {**PUBLISHED_STYLE, **changes}})


def test_absent_config_is_a_bf16_checkpoint():
    assert read_quantization({}) is None and read_quantization({"quantization_config": None}) is None


def test_mxfp8_config_is_read_with_its_ignore_list():
    config = _read()
    assert config == MXFP8Config(ignored_modules=("lm_head", "model.embed_tokens"))
    assert config.ignores("language_model.lm_head") and config.ignores("model.embed_tokens")
    assert not config.ignores("model.layers.0.self_attn.q_proj")
    assert read_quantization({"quantization_config": config.to_json()}) == config


def test_sglang_spelling_ignored_layers_and_minimal_config_are_read():
    assert read_quantization({"quantization_config": {"quant_method": "MXFP8"}}) == MXFP8Config()
    assert _read(modules_to_not_convert=None, ignored_layers=["vision_tower"]).ignores("vision_tower.blocks.0.attn")


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"quant_method": "fp8"}, "quantization_config.quant_method' is 'fp8'"),
        ({"quant_method": "awq"}, "quantization_config.quant_method' is 'awq'"),
        ({"weight_block_size": [128, 128]}, "quantization_config.weight_block_size' is [128, 128]"),
        ({"activation_scheme": "static"}, "quantization_config.activation_scheme' is 'static'"),
        ({"scale_fmt": "fp32"}, "quantization_config.scale_fmt' is 'fp32'"),
        ({"kv_cache_quant_algo": "FP8"}, "quantization_config.kv_cache_quant_algo' is 'FP8'"),
        ({"moe_quant_algo": "NVFP4"}, "quantization_config.moe_quant_algo' is not understood"),
        ({"ignored_layers": ["lm_head"]}, "'quantization_config.ignored_layers' and 'quantization_config.modules_to_not_convert' disagree"),
        ({"modules_to_not_convert": "lm_head"}, "quantization_config.modules_to_not_convert' must be a list"),
        ({"modules_to_not_convert": None, "ignored_layers": "lm_head"}, "quantization_config.ignored_layers' must be a list"),
        ({"ignore": ["lm_head"]}, "quantization_config.ignore' is not understood"),
    ],
)
def test_other_schemes_and_values_are_refused_naming_the_field(changes, named):
    with pytest.raises(M3ConfigError) as refused:
        _read(**changes)
    assert named in str(refused.value)
