"""MXFP8 on Hopper: the weight layout the fit counts there, against hand computations.

On H100/H200 the routed experts stay as the MXFP8 checkpoint stores them (e4m3, 1 byte per
element, plus one e8m0 scale byte per 32 elements: 33/32 bytes) for a W8A16 MoE kernel, and every
other quantized linear is dequantized to BF16 at load. So one TP8 rank holds (the BF16 groups of
tests/recipe/test_fit.py, with the routed experts of its MXFP8 computation):
  q/o projections 60 x 2 x (64 x 128) x 6144 x 2 B / 8            =  1,509,949,440
  k/v projections 60 x 2 x (4 x 128) x 6144 x 2 B / 4 (2 replicas) =    188,743,680
  embedding + lm_head, dense MLPs, shared experts in bf16, / 8      =  1,591,345,152
  routed experts 57 x 128 x 3 x 3072 x 6144 x 33/32 B / 8          = 53,254,029,312
  whole on every rank (vision tower, norms, index q/k, fp32 routers) =  2,360,283,136
                                                              total = 58,904,350,720
Expert parallelism does not change it: EP8 holds 16 whole experts per rank instead of 1/8 of
each of the 128 (tests/test_inspect.py checks that on the meta build).

KV per token per TP8 rank: 60 layers x K and V x 1 KV head x 128 x (2 B bf16 | 1 B fp8) plus
57 sparse layers x a 128-dim index key, bf16 under either KV dtype (256 B) or, with
indexKeyDtype fp8_e4m3, 128 fp8 bytes + a 4-byte scale (132 B):
  bf16 KV: 60 x 512 + 57 x 256 = 45,312;  fp8 KV: 60 x 256 + 57 x 256 = 29,952;
  fp8 KV and fp8 index keys: 60 x 256 + 57 x 132 = 22,884.
"""

from __future__ import annotations

import pytest

from sglang_m3.recipe import estimate_fit, load_recipe, validate_recipe
from sglang_m3.recipe.fit import weight_bytes_per_gpu
from sglang_m3.recipe.model_geometry import M3, WEIGHT_BYTES
from tests.recipe.recipe_factory import LIBRARY, make_recipe

HOPPER_TP8 = 58_904_350_720  # one TP8 rank, by hand in the module docstring
BLACKWELL_TP8 = 57_608_433_664  # every quantized linear in fp8 (tests/recipe/test_fit.py)
EXPERTS_BF16 = 128 * 3 * 3072 * 6144 * 2  # routed experts of one MoE layer: 14,495,514,624
EXPERTS_MXFP8 = 128 * 3 * 3072 * 6144 * 33 // 32  # the same in MXFP8: 7,474,249,728


def h100_mxfp8(ep: int = 1, kv_dtype: str = "auto", index_key_dtype: str = "bf16", **changes):
    """8 x H100 at TP8 (+ EP ``ep``), memFractionStatic 0.88; ``changes`` as make_recipe takes them."""
    return make_recipe(**{
        "spec__hardware": {"profile": "h100"},
        "spec__parallelism": {"tp": 8, "ep": ep},
        "spec__kvCache": {"dtype": kv_dtype, "indexKeyDtype": index_key_dtype},
        "spec__serving": {"memFractionStatic": 0.88, "maxRunningRequests": 2},
        **changes,
    })


def test_hopper_layout_is_bf16_with_the_experts_of_the_mxfp8_checkpoint():
    # each of the 57 MoE layers saves 14,495,514,624 - 7,474,249,728 bytes against BF16
    assert M3.weights.layer_groups["sparse_attention+moe"]["experts"] == EXPERTS_BF16
    assert M3.weights_mxfp8.layer_groups["sparse_attention+moe"]["experts"] == EXPERTS_MXFP8
    assert M3.weights_mxfp8_experts.total_bytes == (
        WEIGHT_BYTES["bf16"] - 57 * (EXPERTS_BF16 - EXPERTS_MXFP8)) == 453_957_849_088
    # every other group as BF16 serves it, in every layer kind and outside the layers
    for kind, groups in M3.weights_mxfp8_experts.layer_groups.items():
        assert {g: b for g, b in groups.items() if g != "experts"} == {
            g: b for g, b in M3.weights.layer_groups[kind].items() if g != "experts"}
    assert M3.weights_mxfp8_experts.first_stage == M3.weights.first_stage
    assert M3.weights_mxfp8_experts.last_stage == M3.weights.last_stage


def test_hopper_weights_per_rank_by_hand():
    assert weight_bytes_per_gpu("mxfp8", 8, 1, mxfp8_residency="routed_experts") == (
        1_509_949_440 + 188_743_680 + 1_591_345_152 + 53_254_029_312 + 2_360_283_136) == HOPPER_TP8
    # Blackwell keeps every quantized linear in fp8; a BF16 recipe is the same on both
    assert weight_bytes_per_gpu("mxfp8", 8, 1) == BLACKWELL_TP8
    assert weight_bytes_per_gpu("bf16", 8, 1, mxfp8_residency="routed_experts") == \
        weight_bytes_per_gpu("bf16", 8, 1)


@pytest.mark.parametrize("ep", [1, 8], ids=["tp8", "tp8-ep8"])
def test_h100_tp8_by_hand(ep):
    bf16_kv, fp8_kv, fp8_keys = (estimate_fit(h100_mxfp8(ep, "auto")),
                                 estimate_fit(h100_mxfp8(ep, "fp8_e4m3")),
                                 estimate_fit(h100_mxfp8(ep, "fp8_e4m3", "fp8_e4m3")))
    for report in (bf16_kv, fp8_kv, fp8_keys):
        assert report.weight_bytes_per_gpu == HOPPER_TP8
        # 80 GB x 0.88 = 70.4 GB static; 70,400,000,000 - 58,904,350,720 of KV
        assert report.kv_pool_bytes == 11_495_649_280
        assert "routed experts" in report.weight_layout
    # 11,495,649,280 / 45,312 = 253,700.6 -> 1,982 pages of 128 = 253,696 tokens: one 128K request
    assert (bf16_kv.kv_bytes_per_token, bf16_kv.pool_tokens) == (45_312, 253_696)
    assert bf16_kv.max_concurrency_at_context == 1
    # / 29,952 = 383,802.7 -> 2,998 pages = 383,744 tokens: two 128K requests
    assert (fp8_kv.kv_bytes_per_token, fp8_kv.pool_tokens) == (29_952, 383_744)
    assert fp8_kv.max_concurrency_at_context == 2
    # / 22,884 = 502,344.4 -> 3,924 pages = 502,272 tokens: three 128K requests
    assert (fp8_keys.kv_bytes_per_token, fp8_keys.pool_tokens) == (22_884, 502_272)
    assert fp8_keys.max_concurrency_at_context == 3


def test_h100_tp8_runs_mxfp8_without_errors_and_tp4_does_not_fit():
    assert not [f for f in validate_recipe(h100_mxfp8()) if f.severity == "error"]
    four = h100_mxfp8(spec__hardware={"profile": "h100", "gpusPerNode": 4},
                      spec__parallelism={"tp": 4})
    # TP4: q/o, dense MLPs/shared experts/vocab and routed experts at twice their TP8 share; k/v
    # split over the 4 KV heads at TP4 and TP8 alike; the replicated part once
    report = estimate_fit(four)
    assert report.weight_bytes_per_gpu == (
        2 * 1_509_949_440 + 188_743_680 + 2 * 1_591_345_152 + 2 * 53_254_029_312 + 2_360_283_136
    ) == 115_259_674_624
    [finding] = [f for f in validate_recipe(four) if f.severity == "error"]
    assert (finding.rule, finding.field) == ("fit.weights", "spec.parallelism")
    assert "115.3 GB per GPU" in finding.message


@pytest.mark.parametrize("name, kv_per_token, pool_tokens, context, at_context", [
    # 70.4e9 - 58,904,350,720 = 11,495,649,280 / 45,312 -> 253,696; three 64K requests
    ("h100-mxfp8-tp8.yaml", 45_312, 253_696, 65_536, 3),
    # the same pool at 29,952 bytes per token -> 383,744; two 128K requests
    ("h100-mxfp8-tp8-fp8kv.yaml", 29_952, 383_744, 131_072, 2),
    # 141 GB x 0.88 = 124.08e9 - 58,904,350,720 = 65,175,649,280 / 45,312 = 1,438,375.6
    # -> 11,237 pages = 1,438,336; ten 128K requests (BF16 on the same node: two)
    ("h200-mxfp8-tp8.yaml", 45_312, 1_438_336, 131_072, 10),
])
def test_library_hopper_mxfp8_recipes_by_hand(name, kv_per_token, pool_tokens, context, at_context):
    recipe = load_recipe(LIBRARY / name)
    report = estimate_fit(recipe)
    assert report.weight_bytes_per_gpu == HOPPER_TP8
    assert (report.kv_bytes_per_token, report.pool_tokens) == (kv_per_token, pool_tokens)
    assert recipe.spec.context_length == context
    assert report.max_concurrency_at_context == at_context == recipe.spec.serving.max_running_requests
    assert validate_recipe(recipe) == []
