"""MXFP8 on Hopper: the weight layout the fit counts there, against hand computations.

On H100/H200 every quantized linear of the MXFP8 checkpoint stays as it is stored (e4m3, 1 byte
per element, plus one e8m0 scale byte per 32 elements: 33/32 bytes) and runs through the
project's W8A16 kernels (routed experts: ``sglang_m3.models.mxfp8_moe``; attention q/k/v/o, dense
MLPs and shared experts: ``sglang_m3.quant.mxfp8_linear``), the layout Blackwell is counted with.
So one TP8 rank holds (tests/recipe/test_fit.py writes each group out):
  q/o projections 60 x 2 x 8192 x 6144 x 33/32 B / 8               =    778,567,680
  k/v projections 60 x 2 x 512 x 6144 x 33/32 B / 4 (2 replicas)    =     97,320,960
  embedding + lm_head (bf16) 614,596,608, dense MLPs 87,588,864,
  shared experts 416,047,104 (33/32 B, / 8)                         =  1,118,232,576
  routed experts 57 x 128 x 3 x 3072 x 6144 x 33/32 B / 8          = 53,254,029,312
  whole on every rank (vision tower, norms, index q/k, fp32 routers) =  2,360,283,136
                                                              total = 57,608,433,664
Before the dense linears had W8A16 kernels they were dequantized to BF16 at load and a rank held
58,904,350,720 bytes (1,295,917,056 more). Expert parallelism does not change it: EP8 holds 16
whole experts per rank instead of 1/8 of each of the 128 (tests/test_inspect.py checks that on
the meta build).

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

HOPPER_TP8 = 57_608_433_664  # one TP8 rank, by hand in the module docstring
EXPERTS_MXFP8 = 128 * 3 * 3072 * 6144 * 33 // 32  # routed experts of one MoE layer: 7,474,249,728


def h100_mxfp8(ep: int = 1, kv_dtype: str = "auto", index_key_dtype: str = "bf16", **changes):
    """8 x H100 at TP8 (+ EP ``ep``), memFractionStatic 0.88; ``changes`` as make_recipe takes them."""
    return make_recipe(**{
        "spec__hardware": {"profile": "h100"},
        "spec__parallelism": {"tp": 8, "ep": ep},
        "spec__kvCache": {"dtype": kv_dtype, "indexKeyDtype": index_key_dtype},
        "spec__serving": {"memFractionStatic": 0.88, "maxRunningRequests": 2},
        **changes,
    })


def test_hopper_counts_the_checkpoints_bytes():
    """The MXFP8 layout is inspect's record of the checkpoint: 443.96 GB, experts at 33/32 bytes."""
    assert M3.weight_layout("mxfp8") is M3.weights_mxfp8 and M3.weight_layout("bf16") is M3.weights
    assert M3.weights_mxfp8.total_bytes == WEIGHT_BYTES["mxfp8"] == 443_956_203_520
    assert M3.weights_mxfp8.layer_groups["sparse_attention+moe"]["experts"] == EXPERTS_MXFP8


def test_hopper_weights_per_rank_by_hand():
    assert weight_bytes_per_gpu("mxfp8", 8, 1) == (
        778_567_680 + 97_320_960 + 1_118_232_576 + 53_254_029_312 + 2_360_283_136) == HOPPER_TP8


@pytest.mark.parametrize("ep", [1, 8], ids=["tp8", "tp8-ep8"])
def test_h100_tp8_by_hand(ep):
    bf16_kv, fp8_kv, fp8_keys = (estimate_fit(h100_mxfp8(ep, "auto")),
                                 estimate_fit(h100_mxfp8(ep, "fp8_e4m3")),
                                 estimate_fit(h100_mxfp8(ep, "fp8_e4m3", "fp8_e4m3")))
    for report in (bf16_kv, fp8_kv, fp8_keys):
        assert report.weight_bytes_per_gpu == HOPPER_TP8
        # 80 GB x 0.88 = 70.4 GB static; 70,400,000,000 - 57,608,433,664 of KV
        assert report.kv_pool_bytes == 12_791_566_336
        assert report.weight_layout == "mxfp8: quantized linears e4m3 + e8m0 scale per 32"
    # 12,791,566,336 / 45,312 = 282,299.8 -> 2,205 pages of 128 = 282,240 tokens: two 128K requests
    assert (bf16_kv.kv_bytes_per_token, bf16_kv.pool_tokens) == (45_312, 282_240)
    assert bf16_kv.max_concurrency_at_context == 2
    # / 29,952 = 427,068.9 -> 3,336 pages = 427,008 tokens: three 128K requests
    assert (fp8_kv.kv_bytes_per_token, fp8_kv.pool_tokens) == (29_952, 427_008)
    assert fp8_kv.max_concurrency_at_context == 3
    # / 22,884 = 558,974.2 -> 4,366 pages = 558,848 tokens: four 128K requests
    assert (fp8_keys.kv_bytes_per_token, fp8_keys.pool_tokens) == (22_884, 558_848)
    assert fp8_keys.max_concurrency_at_context == 4


def test_h100_tp8_runs_mxfp8_without_errors_and_tp4_does_not_fit():
    assert not [f for f in validate_recipe(h100_mxfp8()) if f.severity == "error"]
    four = h100_mxfp8(spec__hardware={"profile": "h100", "gpusPerNode": 4},
                      spec__parallelism={"tp": 4})
    # TP4: q/o, embedding/lm_head/dense MLPs/shared experts and routed experts at twice their TP8
    # share; k/v split over the 4 KV heads at TP4 and TP8 alike; the replicated part once
    report = estimate_fit(four)
    assert report.weight_bytes_per_gpu == (
        2 * 778_567_680 + 97_320_960 + 2 * 1_118_232_576 + 2 * 53_254_029_312 + 2_360_283_136
    ) == 112_759_263_232
    [finding] = [f for f in validate_recipe(four) if f.severity == "error"]
    assert (finding.rule, finding.field) == ("fit.weights", "spec.parallelism")
    assert "112.8 GB per GPU" in finding.message


@pytest.mark.parametrize("name, kv_per_token, pool_tokens, context, at_context", [
    # 70.4e9 - 57,608,433,664 = 12,791,566,336 / 45,312 -> 282,240; four 64K requests
    ("h100-mxfp8-tp8.yaml", 45_312, 282_240, 65_536, 4),
    # the same pool at 29,952 bytes per token -> 427,008; three 128K requests
    ("h100-mxfp8-tp8-fp8kv.yaml", 29_952, 427_008, 131_072, 3),
    # sparse offload: 12,791,566,336 - (512 cache blocks + 1 scratch) x 128 x 29,184 host bytes
    # = 10,875,228,160 / 16,128 GPU bytes per token (index keys, dense layers' K/V) = 674,307.3
    # -> 5,268 pages = 674,304; one 512K request (282,240 tokens without offload hold none)
    ("h100-mxfp8-tp8-512k-offload.yaml", 16_128, 674_304, 524_288, 1),
    # 141 GB x 0.88 = 124.08e9 - 57,608,433,664 = 66,471,566,336 / 45,312 = 1,466,973.9
    # -> 11,460 pages = 1,466,880; eleven 128K requests (BF16 on the same node: two)
    ("h200-mxfp8-tp8.yaml", 45_312, 1_466_880, 131_072, 11),
])
def test_library_hopper_mxfp8_recipes_by_hand(name, kv_per_token, pool_tokens, context, at_context):
    recipe = load_recipe(LIBRARY / name)
    report = estimate_fit(recipe)
    assert report.weight_bytes_per_gpu == HOPPER_TP8
    assert (report.kv_bytes_per_token, report.pool_tokens) == (kv_per_token, pool_tokens)
    assert recipe.spec.context_length == context
    assert report.max_concurrency_at_context == at_context == recipe.spec.serving.max_running_requests
    assert validate_recipe(recipe) == []
