"""Our video preprocessing equals transformers' MiniMaxM3VLVideoProcessor (pixels, grids, tokens)."""

import numpy as np
import pytest
import torch
from transformers.models.minimax_m3_vl.image_processing_minimax_m3_vl import MiniMaxM3VLImageProcessor
from transformers.models.minimax_m3_vl.processing_minimax_m3_vl import MiniMaxM3VLProcessor
from transformers.models.minimax_m3_vl.video_processing_minimax_m3_vl import MiniMaxM3VLVideoProcessor
from transformers.video_utils import VideoMetadata, default_sample_indices_fn

from sglang_m3.multimodal.limits import MediaLimits
from sglang_m3.multimodal.preprocessor import VIDEO_GEOMETRY
from sglang_m3.multimodal.prompt import MediaTokens
from sglang_m3.multimodal.sources import read_media
from sglang_m3.multimodal.video import sample_indices, video_features
from tests.multimodal.media_factory import decode_all_frames, encode_video, random_frames
from tests.multimodal.tiny_vl import tiny_tokenizer

HF = MiniMaxM3VLVideoProcessor()
REFERENCE = MiniMaxM3VLProcessor(
    image_processor=MiniMaxM3VLImageProcessor(), tokenizer=tiny_tokenizer(), video_processor=HF
)


def ours(data: bytes, fps: float, limits: MediaLimits = MediaLimits()):
    source = read_media(data, kind="video", part="video 1", limits=limits)
    return video_features(source, VIDEO_GEOMETRY, limits, fps)


def reference(data: bytes, **sampling):
    frames, native_fps = decode_all_frames(data)
    metadata = VideoMetadata(total_num_frames=len(frames), fps=native_fps, height=frames.shape[1], width=frames.shape[2])
    return HF(
        videos=[frames],
        video_metadata=[metadata],
        do_sample_frames=True,
        return_metadata=True,
        return_tensors="pt",
        **sampling,
    )


@pytest.mark.parametrize(
    "frames,native_fps,width,height,fps,codec,fmt",
    [
        (10, 5, 64, 48, 1.0, "mpeg4", "mp4"),
        (7, 2, 100, 30, 1.0, "mpeg4", "mp4"),
        (30, 30, 90, 90, 2.0, "mpeg4", "mp4"),
        (24, 8, 58, 82, 3.0, "libx264", "mp4"),
        (13, 4, 200, 120, 4.0, "libvpx-vp9", "webm"),
        (9, 3, 33, 47, 0.5, "mpeg4", "avi"),
        (40, 25, 640, 360, 1.5, "libx264", "mkv"),
    ],
)
def test_video_matches_transformers(frames, native_fps, width, height, fps, codec, fmt):
    fmt = {"mkv": "matroska"}.get(fmt, fmt)
    data = encode_video(random_frames(frames, width, height, seed=frames), native_fps, codec=codec, fmt=fmt)
    got = ours(data, fps)
    expected = reference(data, fps=fps)
    assert [list(got.grid_thw)] == expected["video_grid_thw"].tolist()
    assert got.frame_indices == list(expected["video_metadata"][0].frames_indices)
    torch.testing.assert_close(got.pixel_values, expected["pixel_values_videos"], rtol=0, atol=1e-6)
    timestamps = got.timestamps(VIDEO_GEOMETRY.temporal_patch_size)
    assert MediaTokens().video_text(got.grid_thw, 2, timestamps) == REFERENCE.replace_video_token(expected, 0)


def test_frame_cap_matches_transformers_uniform_sampling():
    data = encode_video(random_frames(20, 56, 56), 10)
    got = ours(data, fps=10.0, limits=MediaLimits(max_video_frames=6))
    frames, native_fps = decode_all_frames(data)
    indices = default_sample_indices_fn(VideoMetadata(total_num_frames=len(frames), fps=native_fps), num_frames=6)
    assert got.frame_indices == indices.tolist() == [0, 3, 6, 10, 13, 16]
    expected = HF(videos=[frames[indices]], do_sample_frames=False, return_tensors="pt")
    torch.testing.assert_close(got.pixel_values, expected["pixel_values_videos"], rtol=0, atol=1e-6)


def test_lossless_video_decodes_to_the_generated_frames():
    """With a lossless codec the sampled frames are exactly the frames that were encoded."""
    source_frames = random_frames(6, 56, 28, seed=3)
    data = encode_video(source_frames, 2, codec="png", fmt="mov", pix_fmt="rgb24")
    got = ours(data, fps=1.0)
    assert got.frame_indices == [0, 2, 4]
    expected = HF(
        videos=[np.stack([source_frames[i] for i in (0, 2, 4)])], do_sample_frames=False, return_tensors="pt"
    )
    torch.testing.assert_close(got.pixel_values, expected["pixel_values_videos"], rtol=0, atol=1e-6)


def test_sampling_keeps_at_least_one_frame_and_at_most_the_video():
    assert sample_indices(total_frames=3, native_fps=30.0, fps=1.0, max_frames=768) == [0]
    assert sample_indices(total_frames=5, native_fps=1.0, fps=4.0, max_frames=768) == [0, 1, 2, 3, 4]
    assert sample_indices(total_frames=100, native_fps=1.0, fps=1.0, max_frames=4) == [0, 25, 50, 75]
