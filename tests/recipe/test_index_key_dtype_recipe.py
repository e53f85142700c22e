"""``spec.kvCache.indexKeyDtype``: schema, rendering to the plugin's switch, rules, memory fit."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_m3.recipe import render_launch, validate_recipe
from sglang_m3.recipe.errors import RecipeLoadError
from sglang_m3.recipe.fit import estimate_fit, kv_bytes_per_token
from sglang_m3.recipe.render import INDEX_KEY_DTYPE_ENV
from tests.recipe.recipe_factory import make_recipe


def test_default_is_bf16_and_renders_no_switch():
    recipe = make_recipe()
    assert recipe.spec.kv_cache.index_key_dtype == "bf16"
    assert INDEX_KEY_DTYPE_ENV not in render_launch(recipe).env


def test_fp8_renders_the_plugin_switch_and_no_sglang_flag():
    launch = render_launch(make_recipe(spec__kvCache={"indexKeyDtype": "fp8_e4m3"}))
    assert launch.env[INDEX_KEY_DTYPE_ENV] == "fp8_e4m3"
    assert not any("index" in arg for arg in launch.argv if arg.startswith("--"))


def test_unknown_dtype_is_refused_by_the_schema():
    with pytest.raises(RecipeLoadError, match="spec.kvCache.indexKeyDtype: Input should be 'bf16' or 'fp8_e4m3'"):
        make_recipe(spec__kvCache={"indexKeyDtype": "fp8_e5m2"})


def _findings(recipe):
    return {(f.severity, f.rule, f.field) for f in validate_recipe(recipe)}


def test_setting_the_switch_through_env_is_refused_naming_the_field():
    found = _findings(make_recipe(spec__env={INDEX_KEY_DTYPE_ENV: "fp8_e4m3"}))
    assert ("error", "env.typed-field", f"spec.env.{INDEX_KEY_DTYPE_ENV}") in found
    message = next(f.message for f in validate_recipe(make_recipe(spec__env={INDEX_KEY_DTYPE_ENV: "fp8_e4m3"}))
                   if f.rule == "env.typed-field")
    assert "indexKeyDtype: fp8_e4m3" in message


def test_fp8_keys_are_clean_on_nvidia_and_warned_elsewhere():
    assert not {f for f in _findings(make_recipe(spec__kvCache={"indexKeyDtype": "fp8_e4m3"})) if "index-key" in f[1]}
    amd = make_recipe(spec__model={"path": "MiniMaxAI/MiniMax-M3", "variant": "bf16"}, spec__hardware={"profile": "mi300x"},
                      spec__kvCache={"indexKeyDtype": "fp8_e4m3"})
    assert ("warning", "kv.index-key-fp8-vendor", "spec.kvCache.indexKeyDtype") in _findings(amd)


@settings(max_examples=40, deadline=None)
@given(
    kv_dtype=st.sampled_from(["auto", "bf16", "fp8_e4m3", "fp8_e5m2"]),
    tp=st.sampled_from([1, 2, 4, 8]),
    pp=st.sampled_from([1, 2, 3]),
)
def test_fit_counts_fp8_keys_with_their_scales(kv_dtype, tp, pp):
    """fp8 index keys cost 128 + 4 bytes per sparse layer, whatever the main KV dtype; the rest is unchanged."""
    bf16 = kv_bytes_per_token(kv_dtype, tp, pp)
    fp8 = kv_bytes_per_token(kv_dtype, tp, pp, index_key_dtype="fp8_e4m3")
    if pp == 1:
        assert bf16 - fp8 == 57 * (256 - 132)
    assert 0 < fp8 < bf16


def test_fit_pool_grows_with_fp8_keys():
    base = dict(spec__model={"path": "MiniMaxAI/MiniMax-M3", "variant": "bf16"}, spec__hardware={"profile": "h200"},
                spec__parallelism={"tp": 8})
    bf16 = estimate_fit(make_recipe(**base))
    fp8 = estimate_fit(make_recipe(**base, spec__kvCache={"indexKeyDtype": "fp8_e4m3"}))
    assert (bf16.kv_bytes_per_token, fp8.kv_bytes_per_token) == (45_312, 38_244)
    assert fp8.pool_tokens > bf16.pool_tokens
