"""8x H100 with the MXFP8 checkpoint: the memory fit with inspect's MXFP8 numbers.

The weights fit one 8x H100 node (57.6 GB of 80 GB per GPU at TP8), with and without an FP8 KV
cache; the catalog still refuses MXFP8 on Hopper (``hardware.variant``) because this project has
no Hopper MXFP8 execution path yet (CPU dequantize-at-load only): the recipe files are added when
that rule is lifted by the GPU path (issue 17, part 2).
"""

from __future__ import annotations

from sglang_m3.recipe import estimate_fit, validate_recipe
from sglang_m3.recipe.model_geometry import WEIGHT_BYTES
from tests.recipe.recipe_factory import make_recipe

GB = 10**9


def _h100_mxfp8(kv_dtype: str = "auto"):
    return make_recipe(
        spec__hardware={"profile": "h100", "nodes": 1},
        spec__parallelism={"tp": 8},
        spec__kvCache={"dtype": kv_dtype},
        spec__serving={"memFractionStatic": 0.85, "maxRunningRequests": 8},
        spec__contextLength=131_072,
    )


def test_inspect_measures_the_published_mxfp8_size():
    assert WEIGHT_BYTES["mxfp8"] == 443_956_203_520  # published: ~440 GB
    assert WEIGHT_BYTES["bf16"] == 854_169_948_160


def test_h100_tp8_mxfp8_fits_with_and_without_fp8_kv():
    bf16_kv, fp8_kv = estimate_fit(_h100_mxfp8()), estimate_fit(_h100_mxfp8("fp8_e4m3"))
    for report in (bf16_kv, fp8_kv):
        assert report.weight_bytes_per_gpu == 57_608_433_664  # tests/recipe/test_fit.py by hand
        assert not [f for f in report.findings() if f.severity == "error"], report.findings()
    # 80 GB x 0.85 = 68 GB static; 10,391,566,336 bytes of KV: / 45,312 (bf16) and / 22,656
    # (fp8_e4m3 on Hopper: main KV and index key in fp8) -> 229,329.3 and 458,658.6 tokens
    assert bf16_kv.pool_tokens == 229_248 and fp8_kv.pool_tokens == 458_624
    assert fp8_kv.max_concurrency_at_context == 3 > bf16_kv.max_concurrency_at_context == 1


def test_catalog_still_refuses_mxfp8_on_hopper_until_a_gpu_path_exists():
    findings = validate_recipe(_h100_mxfp8())
    assert any(f.rule == "hardware.variant" and f.severity == "error" for f in findings)
