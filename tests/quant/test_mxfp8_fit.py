"""The MXFP8 checkpoint's size as inspect measures it (the fit's source for every MXFP8 layout).

How Hopper holds it (every quantized linear fp8, as Blackwell) and what fits on 8x H100 is checked
in ``tests/recipe/test_mxfp8_hopper_fit.py``.
"""

from __future__ import annotations

from sglang_m3.recipe.model_geometry import WEIGHT_BYTES


def test_inspect_measures_the_published_mxfp8_size():
    assert WEIGHT_BYTES["mxfp8"] == 443_956_203_520  # published: ~440 GB
    assert WEIGHT_BYTES["bf16"] == 854_169_948_160
