"""Checkpoints whose sizes do not split over ``--tp-size``: refused naming the config field.

SGLang's CPU path pads unaligned head counts on its config object (``adjust_config_with_unaligned_cpu_tp``),
but the M3 classes read the checkpoint's own config.json (``sglang_m3.config.source``) and build the
unpadded model, as they must to load its tensors. A size that does not split over the ranks then
failed deep inside SGLang's parallel layers with a bare ``AssertionError: 3 is not divisible by 2``
(found serving a transformers-saved checkpoint of 6 query / 3 KV heads at ``--tp-size 2``). Each
such size is now refused while the model is built, naming the field and the flag.
"""

from __future__ import annotations

import pytest
from fused_attn_cases import as_rank

from sglang_m3.config import M3TextSpec


def spec(**changes) -> M3TextSpec:
    """A small valid M3 (flat transformers spelling), with ``changes`` applied."""
    sparse = [False, True]
    text = {
        "vocab_size": 128, "hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 16,
        "rotary_dim": 8, "rope_parameters": {"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5},
        "num_hidden_layers": 2, "mlp_layer_types": ["dense", "sparse"],
        "layer_types": ["minimax_m3_sparse" if s else "full_attention" for s in sparse],
        "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32, "shared_intermediate_size": 32,
        "dense_intermediate_size": 48, "routed_scaling_factor": 2.0, "index_n_heads": 2, "index_head_dim": 16,
        "index_block_size": 8, "index_topk_blocks": 3, "index_local_blocks": 1,
    }
    text.update(changes)
    return M3TextSpec.from_config(text)


def build_text_model(spec: M3TextSpec, tp_size: int):
    from sglang_m3.models.minimax_m3 import M3TextModel

    with as_rank(tp_size, 0):
        return M3TextModel(spec, prefix="model")


@pytest.mark.parametrize("kv_heads, tp_size", [(3, 2), (2, 3)])
def test_kv_heads_that_neither_split_nor_replicate_are_refused_by_name(kv_heads, tp_size):
    """3 KV heads over 2 ranks cannot be split; 2 over 3 ranks cannot be replicated evenly."""
    bad = spec(num_key_value_heads=kv_heads, index_n_heads=kv_heads)
    with pytest.raises(ValueError, match=rf"num_key_value_heads.*\({kv_heads}\).*--tp-size.*{tp_size}"):
        build_text_model(bad, tp_size)


@pytest.mark.parametrize(
    "field, changes",
    [
        ("dense_intermediate_size", {"dense_intermediate_size": 45}),
        ("shared_intermediate_size", {"shared_intermediate_size": 33}),
    ],
)
def test_mlp_widths_that_do_not_split_are_refused_by_name(field, changes):
    with pytest.raises(ValueError, match=rf"{field}.*\({changes[field]}\).*--tp-size.*2"):
        build_text_model(spec(**changes), 2)


@pytest.mark.parametrize("kv_heads, tp_size", [(2, 2), (1, 2), (2, 1)])
def test_sizes_that_split_or_replicate_still_build(kv_heads, tp_size):
    """KV heads split (2 over 2) or replicated (1 over 2): built as before."""
    model = build_text_model(spec(num_key_value_heads=kv_heads, index_n_heads=kv_heads), tp_size)
    assert model.layers[1].self_attn.num_kv_heads == max(1, kv_heads // tp_size)
