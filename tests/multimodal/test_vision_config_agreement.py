"""The processor's patching is checked against the checkpoint's ``vision_config`` at start-up."""

from __future__ import annotations

import pytest

from sglang_m3.multimodal.patches import PatchGeometry
from sglang_m3.multimodal.preprocessor import PreprocessConfig, check_against_vision_config

SHIPPED_VISION = {"patch_size": 14, "temporal_patch_size": 2, "spatial_merge_size": 2, "hidden_size": 1280}


def test_matching_geometry_is_accepted():
    check_against_vision_config(PreprocessConfig(), SHIPPED_VISION)


def test_vision_config_without_patch_fields_is_accepted():
    check_against_vision_config(PreprocessConfig(), {"hidden_size": 32})


@pytest.mark.parametrize(
    ("kind", "ours", "theirs", "value"),
    [
        ("image", "patch_size", "patch_size", 16),
        ("image", "merge_size", "spatial_merge_size", 3),
        ("video", "temporal_patch_size", "temporal_patch_size", 1),
    ],
)
def test_disagreement_names_both_fields(kind, ours, theirs, value):
    geometry = PatchGeometry(**{ours: value})
    config = PreprocessConfig(image=geometry) if kind == "image" else PreprocessConfig(video=geometry)
    with pytest.raises(ValueError) as caught:
        check_against_vision_config(config, SHIPPED_VISION)
    assert f"{kind} processor's {ours} ({value})" in str(caught.value)
    assert f"vision_config.{theirs}" in str(caught.value)
