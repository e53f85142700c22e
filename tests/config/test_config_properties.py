"""Properties of config reading over random valid tiny geometries (hypothesis)."""

from __future__ import annotations

import copy

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from m3_config_layouts import hf_text_config, shipped_text_config, vl_wrapper

from sglang_m3.config import M3ConfigError, M3TextSpec

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@st.composite
def specs(draw, hf_expressible: bool = False) -> M3TextSpec:
    """A valid random spec; ``hf_expressible`` keeps to what transformers' flat layout can say
    (swiglu-oai, Gemma norm, routing bias)."""
    layers = draw(st.integers(1, 6))
    kv = draw(st.sampled_from([1, 2, 4]))
    head_dim = draw(st.sampled_from([8, 12, 16, 32]))
    rotary = draw(st.integers(1, head_dim // 2)) * 2
    moe_inter = draw(st.sampled_from([16, 24, 48]))
    experts = draw(st.integers(1, 8))
    topk = draw(st.integers(1, 8))
    local = draw(st.integers(0, 2))
    init = draw(st.integers(0, 1))
    return M3TextSpec(
        vocab_size=draw(st.integers(8, 300)),
        hidden_size=draw(st.sampled_from([16, 40, 96])),
        num_layers=layers,
        num_heads=kv * draw(st.integers(1, 4)),
        num_kv_heads=kv,
        head_dim=head_dim,
        rotary_dim=rotary,
        rope_theta=draw(st.sampled_from([10000.0, 5_000_000.0])),
        rms_norm_eps=draw(st.sampled_from([1e-6, 1e-5])),
        max_position_embeddings=4096,
        dense_intermediate_size=draw(st.sampled_from([32, 64])),
        moe_intermediate_size=moe_inter,
        shared_intermediate_size=draw(st.sampled_from([moe_inter, 2 * moe_inter, 40])),
        num_experts=experts,
        experts_per_token=draw(st.integers(1, experts)),
        routed_scaling_factor=draw(st.sampled_from([1.0, 2.0, 2.5])),
        hidden_act="swigluoai" if hf_expressible else draw(st.sampled_from(["swigluoai", "silu"])),
        swiglu_alpha=1.702,
        swiglu_limit=7.0,
        index_heads=kv,
        index_head_dim=draw(st.integers(rotary, 40)),
        index_block_size=draw(st.sampled_from([4, 8, 16])),
        index_topk_blocks=max(topk, local + init),
        index_local_blocks=local,
        index_init_blocks=init,
        sparse_layers=tuple(draw(st.lists(st.booleans(), min_size=layers, max_size=layers))),
        moe_layers=tuple(draw(st.lists(st.booleans(), min_size=layers, max_size=layers))),
        use_gemma_norm=True if hf_expressible else draw(st.booleans()),
        use_routing_bias=True if hf_expressible else draw(st.booleans()),
        tie_word_embeddings=draw(st.booleans()),
        num_mtp_modules=draw(st.integers(0, 7)),
        num_nextn_predict_layers=draw(st.integers(0, 1)),
    )


@SETTINGS
@given(spec=specs())
def test_shipped_layout_reads_back_the_spec(spec):
    text = shipped_text_config(spec)
    assert M3TextSpec.from_config(text) == spec
    assert M3TextSpec.from_config(vl_wrapper(text)) == spec


@SETTINGS
@given(spec=specs(hf_expressible=True))
def test_shipped_and_hf_layouts_give_the_same_spec(spec):
    shipped = M3TextSpec.from_config(vl_wrapper(shipped_text_config(spec)))
    assert M3TextSpec.from_config(vl_wrapper(hf_text_config(spec))) == shipped == spec


@SETTINGS
@given(spec=specs(), k=st.integers(1, 4), first=st.integers(0, 6))
def test_moe_layer_freq_int_equals_the_explicit_list(spec, k, first):
    text = shipped_text_config(spec)
    explicit = [int(i >= first and i % k == 0) for i in range(spec.num_layers)]
    as_int = {**text, "moe_layer_freq": k, "first_k_dense_replace": first}
    as_list = {**text, "moe_layer_freq": explicit}
    assert M3TextSpec.from_config(as_int) == M3TextSpec.from_config(as_list)
    assert M3TextSpec.from_config(as_int).moe_layers == tuple(bool(e) for e in explicit)


#: values of the wrong type or range for (almost) every field; a few happen to be valid for some
#: fields (a positive int for a size), which the property allows
JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 0),
    st.sampled_from([0.0, -1.5, float("nan"), float("inf"), 1e9, 3]),
    st.text(max_size=4),
    st.lists(st.integers(-1, 3), max_size=3),
    st.lists(st.lists(st.integers(), max_size=1), min_size=1, max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
#: text fields whose absence (None) has a meaning, so None there may be accepted
OPTIONAL = {
    "rms_norm_eps", "max_position_embeddings", "use_qk_norm", "qk_norm_type", "use_gemma_norm",
    "scoring_func", "use_routing_bias", "hidden_act", "swiglu_alpha", "swiglu_limit", "swiglu_beta",
    "num_mtp_modules", "num_nextn_predict_layers", "tie_word_embeddings", "n_shared_experts",
    "sparse_init_block", "use_sparse_attention", "sparse_score_type", "sparse_disable_index_value",
    "rope_parameters", "rotary_dim", "partial_rotary_factor", "sparse_attention_freq",
    "rope_theta", "shared_intermediate_size",  # the other spelling carries it (n_shared_experts for the latter)
}


def _mutations(spec: M3TextSpec):
    text = shipped_text_config(spec)
    top_keys = [("text", key) for key in text if key != "sparse_attention_config"]
    nested_keys = [("nested", key) for key in text["sparse_attention_config"]]
    return text, top_keys + nested_keys


@settings(max_examples=400, deadline=None)
@given(spec=specs(), data=st.data(), junk=JUNK)
def test_single_junk_field_is_refused_naming_it_or_accepted(spec, data, junk):
    text, keys = _mutations(spec)
    where, key = data.draw(st.sampled_from(keys))
    config = copy.deepcopy(text)
    target = config if where == "text" else config["sparse_attention_config"]
    if junk is None and key in OPTIONAL:
        assume(False)
    target[key] = junk
    try:
        M3TextSpec.from_config(config)
    except M3ConfigError as refused:
        assert key in str(refused), f"{key}={junk!r}: {refused}"
    except Exception as other:  # noqa: BLE001 - the property: no other type ever escapes
        pytest.fail(f"{key}={junk!r} raised {type(other).__name__}: {other}")
    else:
        assert junk is not None or key in OPTIONAL


#: (first spelling, second spelling) of one setting: where each lives and how to write a value
DUPLICATES = {
    "rope_theta": (("text", "rope_theta"), ("rope", "rope_theta")),
    "partial_rotary_factor": (("text", "partial_rotary_factor"), ("rope", "partial_rotary_factor")),
    "num_experts": (("text", "num_local_experts"), ("text", "num_experts")),
    "index_topk_blocks": (("nested", "sparse_topk_blocks"), ("text", "index_topk_blocks")),
    "index_block_size": (("nested", "sparse_block_size"), ("text", "index_block_size")),
    "index_head_dim": (("nested", "sparse_index_dim"), ("text", "index_head_dim")),
    "index_local_blocks": (("nested", "sparse_local_block"), ("text", "index_local_blocks")),
    "index_n_heads": (("nested", "sparse_num_index_heads"), ("text", "index_n_heads")),
}


def _section(config: dict, where: str) -> dict:
    return {"text": config, "nested": config["sparse_attention_config"], "rope": config["rope_parameters"]}[where]


@SETTINGS
@given(spec=specs(), setting=st.sampled_from(sorted(DUPLICATES)), bump=st.sampled_from([0, 0, 2, 4]))
def test_duplicate_spellings_must_agree(spec, setting, bump):
    text = shipped_text_config(spec)
    (where_a, key_a), (where_b, key_b) = DUPLICATES[setting]
    value = _section(text, where_a)[key_a]
    other = value * 2 if bump and isinstance(value, float) else value + bump
    _section(text, where_b)[key_b] = other
    if other == value:
        assert M3TextSpec.from_config(text) == spec
    else:
        with pytest.raises(M3ConfigError) as refused:
            M3TextSpec.from_config(text)
        assert key_a in str(refused.value) or key_b in str(refused.value)


@SETTINGS
@given(spec=specs(hf_expressible=True), flip=st.booleans())
def test_layer_schedules_in_both_spellings_must_agree(spec, flip):
    text = shipped_text_config(spec)
    hf = hf_text_config(spec)
    both = {**text, "mlp_layer_types": list(hf["mlp_layer_types"]), "layer_types": list(hf["layer_types"])}
    if not flip:
        assert M3TextSpec.from_config(both) == spec
        return
    which = "mlp_layer_types" if spec.num_layers % 2 else "layer_types"
    both[which][0] = {"sparse": "dense", "dense": "sparse", "minimax_m3_sparse": "full_attention", "full_attention": "minimax_m3_sparse"}[both[which][0]]
    with pytest.raises(M3ConfigError, match=which):
        M3TextSpec.from_config(both)
