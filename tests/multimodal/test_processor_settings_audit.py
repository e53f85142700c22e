"""Processor files saved by transformers (and the shipped form SGLang reads) drive our preprocessing
as they drive transformers' processor; settings we do not implement are refused at start-up."""

from __future__ import annotations

import asyncio
import io

import pytest
import torch
from PIL import Image
from transformers import AutoProcessor
from transformers.models.minimax_m3_vl import MiniMaxM3VLImageProcessor, MiniMaxM3VLProcessor, MiniMaxM3VLVideoProcessor
from transformers.video_utils import VideoMetadata

from sglang_m3.multimodal.pool import MediaWorkerPool
from sglang_m3.multimodal.preprocessor import MediaPreprocessor, PreprocessConfig
from tests.multimodal.media_factory import decode_all_frames, encode_image, encode_video, random_frames, random_image
from tests.multimodal.tiny_vl import tiny_tokenizer

GEOMETRY = {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 4}


def saved_and_loaded(tmp_path, image_kwargs=None, video_kwargs=None):
    """transformers' processor saved with ``save_pretrained`` and read back with AutoProcessor."""
    processor = MiniMaxM3VLProcessor(
        image_processor=MiniMaxM3VLImageProcessor(**(image_kwargs or {})),
        tokenizer=tiny_tokenizer(),
        video_processor=MiniMaxM3VLVideoProcessor(**(video_kwargs or {})),
    )
    processor.save_pretrained(tmp_path)
    return AutoProcessor.from_pretrained(tmp_path)


def preprocess(config: PreprocessConfig, images=(), videos=()):
    pool = MediaWorkerPool(workers=1, max_pending=2)
    try:
        return asyncio.run(MediaPreprocessor(config, pool).process(list(images), list(videos)))
    finally:
        pool.shutdown()


def test_saved_geometry_and_pixel_bounds_drive_images_as_in_transformers(tmp_path):
    loaded = saved_and_loaded(tmp_path, {**GEOMETRY, "min_pixels": 5000, "max_pixels": 300000}, GEOMETRY)
    data = encode_image(random_image(700, 500, seed=21), "PNG")
    got = preprocess(PreprocessConfig.from_settings(loaded, None), images=[data])
    expected = loaded(text=["]<]image[>["], images=[Image.open(io.BytesIO(data))], return_tensors="pt")
    assert [list(got.images[0].grid_thw)] == expected["image_grid_thw"].tolist()
    torch.testing.assert_close(got.images[0].pixel_values, expected["pixel_values"], rtol=0, atol=1e-6)
    image_token = loaded.tokenizer.convert_tokens_to_ids("]<]image[>[")
    assert got.image_texts[0].count("]<]image[>[") == int((expected["input_ids"] == image_token).sum())


def test_the_saved_video_rate_is_the_default_sampling_rate(tmp_path):
    """transformers samples at the video processor's saved fps when the call names none; ours took
    1 fps whatever the checkpoint said."""
    loaded = saved_and_loaded(tmp_path, video_kwargs={"fps": 2.0})
    data = encode_video(random_frames(12, 64, 40, seed=4), 4)
    got = preprocess(PreprocessConfig.from_settings(loaded, None), videos=[data])
    frames, native = decode_all_frames(data)
    metadata = VideoMetadata(total_num_frames=len(frames), fps=native, height=frames.shape[1], width=frames.shape[2])
    expected = loaded.video_processor(
        videos=[frames], video_metadata=[metadata], do_sample_frames=True, return_metadata=True, return_tensors="pt"
    )
    assert got.videos[0].frame_indices == list(expected["video_metadata"][0].frames_indices) == [0, 2, 4, 6, 8, 10]
    assert [list(got.videos[0].grid_thw)] == expected["video_grid_thw"].tolist()
    torch.testing.assert_close(got.videos[0].pixel_values, expected["pixel_values_videos"], rtol=0, atol=1e-6)


def test_the_server_rate_still_wins_over_the_saved_one(tmp_path):
    loaded = saved_and_loaded(tmp_path, video_kwargs={"fps": 2.0})
    assert PreprocessConfig.from_settings(loaded, {"video": {"fps": 0.5}}).limits.video_fps == 0.5
    assert PreprocessConfig.from_settings(loaded, {"limits": {"video_fps": 3.0}}).limits.video_fps == 3.0


def test_a_saved_rate_outside_the_limits_is_traced_to_the_checkpoint(tmp_path):
    loaded = saved_and_loaded(tmp_path, video_kwargs={"fps": 24.0})
    with pytest.raises(ValueError, match=r"video_fps 24\.0 is the checkpoint's video processor fps"):
        PreprocessConfig.from_settings(loaded, None)
    assert PreprocessConfig.from_settings(loaded, {"limits": {"max_video_fps": 30.0}}).limits.video_fps == 24.0


@pytest.mark.parametrize(
    "kind,setting,message",
    [
        ("image", {"resample": 2}, r"the checkpoint's image processor sets resample=2; sglang-m3 supports only bicubic"),
        ("video", {"resample": 0}, r"the checkpoint's video processor sets resample=0; sglang-m3 supports only bicubic"),
        ("image", {"do_normalize": False}, r"the checkpoint's image processor sets do_normalize=False"),
        ("video", {"do_rescale": False}, r"the checkpoint's video processor sets do_rescale=False"),
        ("image", {"do_convert_rgb": False}, r"the checkpoint's image processor sets do_convert_rgb=False"),
    ],
)
def test_settings_we_do_not_implement_are_refused_at_startup(tmp_path, kind, setting, message):
    """They were ignored: every image came out unlike transformers' processor of the same files."""
    loaded = saved_and_loaded(tmp_path, **{f"{kind}_kwargs": setting})
    with pytest.raises(ValueError, match=message):
        PreprocessConfig.from_settings(loaded, None)


def test_the_shipped_form_reader_keeps_its_geometry_and_transformers_defaults():
    """SGLang's reader of the published preprocessor_config.json builds these processors."""
    from sglang.srt.multimodal.processors.minimax_m31_media import MiniMaxM31ImageProcessor, MiniMaxM31VideoProcessor

    shipped = MiniMaxM3VLProcessor(
        image_processor=MiniMaxM31ImageProcessor(max_size=(672, 672), **GEOMETRY),
        tokenizer=tiny_tokenizer(),
        video_processor=MiniMaxM31VideoProcessor(max_size=(672, 672), **GEOMETRY),
    )
    config = PreprocessConfig.from_settings(shipped, None)
    for geometry, reference in ((config.image, MiniMaxM3VLImageProcessor()), (config.video, MiniMaxM3VLVideoProcessor())):
        assert (geometry.patch_size, geometry.temporal_patch_size, geometry.merge_size) == (16, 2, 4)
        assert geometry.image_mean == tuple(reference.image_mean) and geometry.image_std == tuple(reference.image_std)
    assert (config.image.min_pixels, config.image.max_pixels) == (3136, 451584)
    assert (config.video.min_pixels, config.video.max_pixels, config.limits.video_fps) == (3136, 602112, 1.0)
