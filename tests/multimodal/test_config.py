"""Media limits and preprocessing settings: validation names the field at fault."""

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st
from transformers.models.minimax_m3_vl.image_processing_minimax_m3_vl import MiniMaxM3VLImageProcessor
from transformers.models.minimax_m3_vl.processing_minimax_m3_vl import MiniMaxM3VLProcessor
from transformers.models.minimax_m3_vl.video_processing_minimax_m3_vl import MiniMaxM3VLVideoProcessor

from sglang_m3.multimodal.limits import MediaLimits
from sglang_m3.multimodal.preprocessor import PreprocessConfig
from tests.multimodal.tiny_vl import tiny_tokenizer

NUMERIC = [f.name for f in dataclasses.fields(MediaLimits) if f.name not in ("local_media_root", "video_fps")]


@given(st.sampled_from(NUMERIC), st.one_of(st.integers(max_value=0), st.floats(max_value=0), st.booleans(), st.text()))
def test_non_positive_or_non_numeric_limits_are_refused_by_name(name, value):
    with pytest.raises(ValueError, match=f"media limit {name} must be a positive number"):
        MediaLimits.from_mapping({name: value})


@given(st.sampled_from([n for n in NUMERIC if not n.endswith("video_fps")]), st.integers(1, 10**12))
def test_positive_limits_are_taken(name, value):
    assert getattr(MediaLimits.from_mapping({name: value}), name) == value


def test_unknown_limit_and_fps_outside_bounds():
    with pytest.raises(ValueError, match=r"unknown media limit\(s\) \['max_imgs'\]"):
        MediaLimits.from_mapping({"max_imgs": 3})
    with pytest.raises(ValueError, match=r"video_fps 20.0 is outside \[min_video_fps 0.1, max_video_fps 10.0\]"):
        MediaLimits.from_mapping({"video_fps": 20.0})


def test_settings_come_from_the_checkpoint_processor_then_the_server():
    processor = MiniMaxM3VLProcessor(
        image_processor=MiniMaxM3VLImageProcessor(size={"shortest_edge": 6272, "longest_edge": 100352}),
        tokenizer=tiny_tokenizer(),
        video_processor=MiniMaxM3VLVideoProcessor(max_pixels=50176),
    )
    config = PreprocessConfig.from_settings(processor, None)
    assert (config.image.min_pixels, config.image.max_pixels, config.video.max_pixels) == (6272, 100352, 50176)
    config = PreprocessConfig.from_settings(
        processor, {"image": {"max_pixels": 12544}, "video": {"fps": 2.0}, "limits": {"max_images": 3}}
    )
    assert (config.image.max_pixels, config.limits.video_fps, config.limits.max_images) == (12544, 2.0, 3)


@pytest.mark.parametrize(
    "settings,message",
    [
        ({"imagez": {}}, r"unknown mm_process_config section\(s\) \['imagez'\]"),
        ({"image": {"do_resize": False}}, r"unknown mm_process_config.image key\(s\) \['do_resize'\]"),
        ({"video": {"min_pixels": 10, "max_pixels": 5}}, r"mm_process_config.video: need 0 < min_pixels <= max_pixels"),
        ({"limits": {"max_videos": 0}}, r"media limit max_videos must be a positive number"),
    ],
)
def test_bad_server_settings_fail_at_startup(settings, message):
    with pytest.raises(ValueError, match=message):
        PreprocessConfig.from_settings(None, settings)
