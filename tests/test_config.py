"""M3 config parsing: flat and nested sparse forms, VL wrapper, errors that name the field."""

from __future__ import annotations

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_m3.config import M3ConfigError, M3TextSpec
from sglang_m3.tiny.checkpoint import TinyGeometry, text_config_flat

SPECIAL = {"]~!b[": 1, "[e~[": 3}


def flat() -> dict:
    return text_config_flat(TinyGeometry(), SPECIAL)


#: the tiny config's RoPE settings less ``partial_rotary_factor``: ``rotary_dim`` alone counts
ROPE_WITHOUT_FACTOR = {key: value for key, value in flat()["rope_parameters"].items() if key != "partial_rotary_factor"}


def to_nested_sparse_form(text: dict) -> dict:
    """The same settings with the sparse ones moved into ``sparse_attention_config``."""
    text = dict(text)
    freq = [1 if t == "minimax_m3_sparse" else 0 for t in text.pop("layer_types")]
    text["sparse_attention_config"] = {
        "use_sparse_attention": True,
        "sparse_index_dim": text.pop("index_head_dim"),
        "sparse_num_index_heads": text.pop("index_n_heads"),
        "sparse_topk_blocks": text.pop("index_topk_blocks"),
        "sparse_block_size": text.pop("index_block_size"),
        "sparse_score_type": "max",
        "sparse_init_block": 0,
        "sparse_local_block": text.pop("index_local_blocks"),
        "sparse_attention_freq": freq,
        "sparse_disable_index_value": freq,
    }
    return text


def test_flat_and_nested_forms_give_the_same_spec():
    assert M3TextSpec.from_config(flat()) == M3TextSpec.from_config(to_nested_sparse_form(flat()))


def test_vl_wrapper_reads_text_config():
    spec = M3TextSpec.from_config({"model_type": "minimax_m3_vl", "text_config": flat(), "vision_config": {}})
    assert spec == M3TextSpec.from_config(flat())
    assert spec.sparse_layer_ids == [1, 2, 3] and spec.dense_layer_ids == [0]
    assert spec.moe_layers == (False, True, True, True)


@pytest.mark.parametrize("top, text, tied", [(True, False, True), (False, True, True), (False, False, False), (True, True, True)])
def test_embeddings_are_tied_when_either_level_says_so(top, text, tied):
    """As transformers' MiniMaxM3VLConfig ties them: its VL model saves no lm_head when tied at
    the top level over an untied text config."""
    config = {"model_type": "minimax_m3_vl", "text_config": {**flat(), "tie_word_embeddings": text},
              "vision_config": {}, "tie_word_embeddings": top}
    assert M3TextSpec.from_config(config).tie_word_embeddings is tied


def test_a_partial_rotary_factor_wins_over_a_disagreeing_rotary_dim(caplog):
    """transformers rotates ``head_dim x partial_rotary_factor`` channels and writes its default
    ``rotary_dim`` 64 beside any factor it saves; the disagreement is logged with both fields."""
    text = {**flat(), "rotary_dim": 64, "partial_rotary_factor": 0.5}
    with caplog.at_level("WARNING"):
        spec = M3TextSpec.from_config(text)
    assert spec.rotary_dim == text["head_dim"] // 2
    assert "'rotary_dim' (64)" in caplog.text and "'partial_rotary_factor' (0.5" in caplog.text


def test_nested_init_block_is_kept():
    nested = to_nested_sparse_form(flat())
    nested["sparse_attention_config"]["sparse_init_block"] = 1
    assert M3TextSpec.from_config(nested).index_init_blocks == 1


def test_init_block_survives_transformers_parsing(tmp_path):
    """transformers drops sparse_attention_config; the raw config.json still has it."""
    import json

    from transformers.models.minimax_m3_vl import MiniMaxM3VLTextConfig

    nested = to_nested_sparse_form(flat())
    nested["sparse_attention_config"]["sparse_init_block"] = 1
    (tmp_path / "config.json").write_text(json.dumps(nested))
    parsed = MiniMaxM3VLTextConfig(**copy.deepcopy(nested))
    assert M3TextSpec.from_config(parsed, str(tmp_path)).index_init_blocks == 1


@pytest.mark.parametrize(
    "change, field",
    [
        ({"index_topk_blocks": 0}, "index_topk_blocks"),
        ({"index_n_heads": 3}, "index_n_heads"),
        ({"index_local_blocks": -1}, "index_local_blocks"),
        ({"index_local_blocks": 5}, "index_local_blocks"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"layer_types": ["full_attention", "linear"]}, "layer_types"),
        ({"mlp_layer_types": ["dense", "sparse", "sparse", "mixture"]}, "mlp_layer_types[3]"),
        ({"rotary_dim": 7, "rope_parameters": ROPE_WITHOUT_FACTOR}, "rotary_dim"),  # a factor would win over it
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ({"hidden_size": None}, "hidden_size"),
        ({"index_head_dim": 8}, "index_head_dim"),
    ],
)
def test_bad_values_name_the_field(change, field):
    config = {**flat(), **change}
    with pytest.raises(M3ConfigError, match=field.replace("[", r"\[").replace("]", r"\]")):
        M3TextSpec.from_config(config)


def test_unknown_nested_key_is_named():
    nested = to_nested_sparse_form(flat())
    nested["sparse_attention_config"]["sparse_topk"] = 8
    with pytest.raises(M3ConfigError, match="sparse_topk"):
        M3TextSpec.from_config(nested)


def test_block_size_must_be_whole_pages():
    spec = M3TextSpec.from_config(flat())  # block size 16
    spec.validate_page_size(16)
    spec.validate_page_size(1)
    with pytest.raises(M3ConfigError, match="index_block_size.*page"):
        spec.validate_page_size(128)


@settings(max_examples=50, deadline=None)
@given(
    layers=st.lists(st.booleans(), min_size=1, max_size=8),
    topk=st.integers(1, 32),
    block=st.sampled_from([16, 32, 64, 128]),
    kv=st.sampled_from([1, 2, 4]),
    local=st.integers(0, 2),
)
def test_nested_round_trip_property(layers, topk, block, kv, local):
    config = {
        **flat(),
        "num_hidden_layers": len(layers),
        "layer_types": ["minimax_m3_sparse" if s else "full_attention" for s in layers],
        "mlp_layer_types": ["sparse"] * len(layers),
        "index_topk_blocks": topk,
        "index_block_size": block,
        "num_key_value_heads": kv,
        "index_n_heads": kv,
        "index_local_blocks": min(local, topk),
    }
    assert M3TextSpec.from_config(config) == M3TextSpec.from_config(to_nested_sparse_form(config))
