"""Our image preprocessing equals transformers' MiniMaxM3VLImageProcessor (pixels, grids, tokens)."""

import io

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from transformers.models.minimax_m3_vl.image_processing_minimax_m3_vl import (
    MiniMaxM3VLImageProcessor,
    smart_resize,
)
from transformers.models.minimax_m3_vl.processing_minimax_m3_vl import MiniMaxM3VLProcessor
from transformers.models.minimax_m3_vl.video_processing_minimax_m3_vl import MiniMaxM3VLVideoProcessor

from sglang_m3.multimodal.errors import MediaError
from sglang_m3.multimodal.image import image_features
from sglang_m3.multimodal.limits import MediaLimits
from sglang_m3.multimodal.patches import PatchGeometry, fit_size
from sglang_m3.multimodal.prompt import MediaTokens
from sglang_m3.multimodal.sources import read_media
from tests.multimodal.media_factory import encode_image, random_image
from tests.multimodal.tiny_vl import tiny_tokenizer

HF = MiniMaxM3VLImageProcessor()
GEOMETRY = PatchGeometry()

CASES = [
    (37, 53, "RGB", "PNG"),
    (1, 1, "RGB", "PNG"),
    (3, 2, "L", "PNG"),
    (5, 300, "L", "PNG"),
    (301, 17, "RGBA", "PNG"),
    (64, 64, "P", "PNG"),
    (95, 41, "P", "GIF"),
    (120, 80, "LA", "PNG"),
    (333, 222, "RGB", "JPEG"),
    (200, 201, "CMYK", "JPEG"),
    (77, 99, "RGB", "WEBP"),
    (56, 56, "RGB", "BMP"),
    (41, 29, "RGB", "TIFF"),
    (2000, 1500, "RGB", "JPEG"),
    (4000, 300, "RGB", "PNG"),
    (28, 5600, "L", "PNG"),
]


def ours(data: bytes, limits: MediaLimits = MediaLimits(), geometry: PatchGeometry = GEOMETRY):
    return image_features(read_media(data, kind="image", part="image 1", limits=limits), geometry, limits)


@pytest.mark.parametrize("width,height,mode,fmt", CASES)
def test_image_matches_transformers(width, height, mode, fmt):
    data = encode_image(random_image(width, height, mode, seed=width * height), fmt)
    got = ours(data)
    expected = HF(images=[Image.open(io.BytesIO(data))], return_tensors="pt")
    assert [list(got.grid_thw)] == expected["image_grid_thw"].tolist()
    assert got.pixel_values.dtype == torch.float32
    torch.testing.assert_close(got.pixel_values, expected["pixel_values"], rtol=0, atol=1e-6)
    tokens = MediaTokens()
    reference = MiniMaxM3VLProcessor(
        image_processor=HF, tokenizer=tiny_tokenizer(), video_processor=MiniMaxM3VLVideoProcessor()
    )
    assert tokens.image_text(got.grid_thw, 2) == reference.replace_image_token(expected, 0)


def test_custom_pixel_bounds_match_transformers():
    data = encode_image(random_image(640, 480), "PNG")
    bounds = {"shortest_edge": 28 * 28 * 8, "longest_edge": 28 * 28 * 30}
    hf = MiniMaxM3VLImageProcessor(size=bounds)
    geometry = PatchGeometry(min_pixels=bounds["shortest_edge"], max_pixels=bounds["longest_edge"])
    got = ours(data, geometry=geometry)
    expected = hf(images=[Image.open(io.BytesIO(data))], return_tensors="pt")
    assert [list(got.grid_thw)] == expected["image_grid_thw"].tolist()
    torch.testing.assert_close(got.pixel_values, expected["pixel_values"], rtol=0, atol=1e-6)


@settings(max_examples=400, deadline=None)
@given(
    height=st.integers(1, 20000),
    width=st.integers(1, 20000),
    min_pixels=st.integers(1, 200_000),
    extra=st.integers(0, 3_000_000),
)
def test_fit_size_equals_smart_resize(height, width, min_pixels, extra):
    geometry = PatchGeometry(min_pixels=min_pixels, max_pixels=min_pixels + extra)
    try:
        expected = smart_resize(height, width, factor=28, min_pixels=min_pixels, max_pixels=min_pixels + extra)
    except ValueError:
        with pytest.raises(ValueError, match="aspect ratio"):
            fit_size(height, width, geometry)
        return
    assert fit_size(height, width, geometry) == expected


def test_extreme_aspect_ratio_is_refused_naming_the_part():
    data = encode_image(random_image(2010, 10), "PNG")
    with pytest.raises(MediaError, match=r"^image 1: aspect ratio 201\.0 is over the limit of 200"):
        ours(data)
