"""Audit against transformers' M3 processors with inputs shaped unlike the other tests.

Pixels are compared exactly (atol 1e-6 on float32 values that come out bit-identical: the same
uint8 bicubic-antialias resize and the same fused ``(x - mean / r) / (std / r)`` normalisation).
Where transformers itself has no answer (frames of differing sizes), ours must refuse naming
the part, as transformers refuses.
"""

from __future__ import annotations

import asyncio
import base64
import io

import av
import numpy as np
import pytest
import torch
from PIL import Image
from transformers.models.minimax_m3_vl.image_processing_minimax_m3_vl import MiniMaxM3VLImageProcessor
from transformers.models.minimax_m3_vl.video_processing_minimax_m3_vl import MiniMaxM3VLVideoProcessor
from transformers.video_utils import VideoMetadata

from sglang_m3.multimodal.errors import MediaError
from sglang_m3.multimodal.image import image_features
from sglang_m3.multimodal.limits import MediaLimits
from sglang_m3.multimodal.options import item_options
from sglang_m3.multimodal.patches import PatchGeometry
from sglang_m3.multimodal.pool import MediaWorkerPool
from sglang_m3.multimodal.preprocessor import VIDEO_GEOMETRY, MediaPreprocessor, PreprocessConfig
from sglang_m3.multimodal.sources import read_media
from sglang_m3.multimodal.video import video_features
from tests.multimodal.media_factory import decode_all_frames, encode_image, encode_video, random_frames, random_image

LOSSLESS = {"codec": "png", "fmt": "mov", "pix_fmt": "rgb24"}


def ours_image(item, geometry: PatchGeometry = PatchGeometry(), limits: MediaLimits = MediaLimits()):
    return image_features(read_media(item, kind="image", part="image 1", limits=limits), geometry, limits)


def ours_video(data: bytes, fps: float, geometry: PatchGeometry = VIDEO_GEOMETRY, limits: MediaLimits = MediaLimits()):
    return video_features(read_media(data, kind="video", part="video 1", limits=limits), geometry, limits, fps)


def assert_image_matches(got, expected) -> None:
    assert [list(got.grid_thw)] == expected["image_grid_thw"].tolist()
    torch.testing.assert_close(got.pixel_values, expected["pixel_values"], rtol=0, atol=1e-6)


def odd_mode_image(mode: str) -> Image.Image:
    """Modes the other tests do not make; sizes not multiples of 28."""
    rng = np.random.default_rng(len(mode))
    if mode == "I;16":
        return Image.fromarray(rng.integers(0, 65536, (31, 45)).astype(np.uint16))
    if mode == "F":
        return Image.fromarray((rng.random((31, 45)) * 300).astype(np.float32))
    if mode == "P+transparency":
        image = random_image(45, 31, "P", seed=3)
        image.info["transparency"] = 5
        return image
    return random_image(45, 31, seed=4).convert(mode)


@pytest.mark.parametrize(
    "mode,fmt",
    [("I;16", "PNG"), ("I;16", "TIFF"), ("F", "TIFF"), ("1", "PNG"), ("LAB", "TIFF"), ("YCbCr", "TIFF"),
     ("CMYK", "TIFF"), ("P+transparency", "PNG"), ("LA", "TIFF"), ("RGBA", "WEBP")],
)
def test_uncommon_image_modes_match_transformers(mode, fmt):
    data = encode_image(odd_mode_image(mode), fmt)
    assert_image_matches(ours_image(data), MiniMaxM3VLImageProcessor()(images=[Image.open(io.BytesIO(data))], return_tensors="pt"))


@pytest.mark.parametrize("width,height", [(1, 199), (199, 1), (3, 600), (55, 57), (673, 673), (2003, 29)])
def test_extreme_sizes_match_transformers(width, height):
    data = encode_image(random_image(width, height, seed=width + height), "PNG")
    assert_image_matches(ours_image(data), MiniMaxM3VLImageProcessor()(images=[Image.open(io.BytesIO(data))], return_tensors="pt"))


@pytest.mark.parametrize("patch,temporal,merge", [(8, 1, 1), (16, 2, 4), (7, 3, 3)])
def test_other_patch_geometries_match_transformers(patch, temporal, merge):
    kwargs = {"patch_size": patch, "temporal_patch_size": temporal, "merge_size": merge}
    reference = MiniMaxM3VLImageProcessor(**kwargs)
    geometry = PatchGeometry(**kwargs, min_pixels=reference.size["shortest_edge"], max_pixels=reference.size["longest_edge"])
    data = encode_image(random_image(91, 37, seed=patch), "PNG")
    expected = reference(images=[Image.open(io.BytesIO(data))], return_tensors="pt")
    assert_image_matches(ours_image(data, geometry), expected)


def test_in_memory_pil_images_are_taken_as_transformers_takes_them():
    """SGLang's Engine API passes PIL images through to the processor (``image_data`` is typed
    ``str | bytes | dict | ImageData | PIL.Image``); they were refused as unsupported input."""
    rgba = random_image(61, 150, "RGBA", seed=11)
    got = ours_image(rgba)
    assert_image_matches(got, MiniMaxM3VLImageProcessor()(images=[rgba], return_tensors="pt"))


def test_in_memory_pil_images_keep_the_limits_and_name_the_part():
    with pytest.raises(MediaError, match=r"^image 1: declared size 64x48 \(3072 pixels\) is over the limit of 1000"):
        ours_image(random_image(64, 48), limits=MediaLimits(max_image_pixels=1000))
    with pytest.raises(MediaError, match=r"^video 1: content is a PIL image, not a video"):
        read_media(random_image(8, 8), kind="video", part="video 1", limits=MediaLimits())


def test_one_pil_image_shared_by_parts_decodes_on_parallel_workers():
    lazy = Image.open(io.BytesIO(encode_image(random_image(300, 200, seed=12), "PNG")))
    pool = MediaWorkerPool(workers=2, max_pending=4)
    try:
        result = asyncio.run(MediaPreprocessor(PreprocessConfig(), pool).process([lazy] * 4, []))
    finally:
        pool.shutdown()
    first = result.images[0].pixel_values
    assert all(torch.equal(image.pixel_values, first) for image in result.images[1:])
    assert_image_matches(result.images[0], MiniMaxM3VLImageProcessor()(images=[lazy], return_tensors="pt"))


def reference_video(data: bytes, processor: MiniMaxM3VLVideoProcessor, fps: float):
    frames, native = decode_all_frames(data)
    metadata = VideoMetadata(total_num_frames=len(frames), fps=native, height=frames.shape[1], width=frames.shape[2])
    return processor(
        videos=[frames], video_metadata=[metadata], do_sample_frames=True, fps=fps, return_metadata=True, return_tensors="pt"
    )


@pytest.mark.parametrize(
    "patch,temporal,merge,frames",
    [(14, 2, 2, 1), (14, 2, 2, 5), (8, 1, 1, 5), (16, 2, 4, 7), (14, 3, 2, 7), (16, 4, 1, 5)],
)
def test_videos_with_odd_frame_counts_and_geometries_match_transformers(patch, temporal, merge, frames):
    reference = MiniMaxM3VLVideoProcessor(patch_size=patch, temporal_patch_size=temporal, merge_size=merge)
    geometry = PatchGeometry(
        patch_size=patch, temporal_patch_size=temporal, merge_size=merge, min_pixels=reference.min_pixels, max_pixels=reference.max_pixels
    )
    data = encode_video(random_frames(frames, 70, 45, seed=frames), 1, **LOSSLESS)
    got = ours_video(data, 1.0, geometry)
    expected = reference_video(data, reference, 1.0)
    assert [list(got.grid_thw)] == expected["video_grid_thw"].tolist()
    assert got.frame_indices == list(expected["video_metadata"][0].frames_indices)
    torch.testing.assert_close(got.pixel_values, expected["pixel_values_videos"], rtol=0, atol=1e-6)


def test_wide_video_frames_match_transformers_given_their_channel_layout():
    """600x3 frames: transformers guesses channels-first for (3, 600, 3) arrays unless told."""
    data = encode_video(random_frames(4, 600, 3, seed=2), 1, **LOSSLESS)
    frames, _ = decode_all_frames(data)
    expected = MiniMaxM3VLVideoProcessor()(videos=[frames], input_data_format="channels_last", return_tensors="pt")
    got = ours_video(data, 1.0)
    assert [list(got.grid_thw)] == expected["video_grid_thw"].tolist() == [[2, 2, 58]]
    torch.testing.assert_close(got.pixel_values, expected["pixel_values_videos"], rtol=0, atol=1e-6)


def stream_of_two_sizes() -> bytes:
    """An MPEG-TS of 6 frames at 64x48 followed by 6 at 200x60 (concatenated segments)."""
    segments = []
    for width, height in ((64, 48), (200, 60)):
        buffer = io.BytesIO()
        with av.open(buffer, "w", format="mpegts") as container:
            stream = container.add_stream("libx264", rate=2)
            stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
            for array in random_frames(6, width, height):
                for packet in stream.encode(av.VideoFrame.from_ndarray(array, format="rgb24")):
                    container.mux(packet)
            for packet in stream.encode():
                container.mux(packet)
        segments.append(buffer.getvalue())
    return b"".join(segments)


def test_frames_of_differing_sizes_are_refused_naming_the_video_and_frame():
    """They were squashed into the declared size (aspect lost, larger frames past max_frame_pixels)."""
    with pytest.raises(ValueError, match="same shape"):
        MiniMaxM3VLVideoProcessor()(videos=[[random_image(64, 48), random_image(200, 60)]])
    with pytest.raises(MediaError) as caught:
        ours_video(stream_of_two_sizes(), 2.0)
    assert caught.value.part == "video 1"
    assert caught.value.reason.startswith("frame 6 is 200x60 but the video declares 64x48 frames")


def video_fps(item, part: str = "video 1") -> float | None:
    """The request's own rate for one video part (None: the server's)."""
    return item_options(item, kind="video", part=part, geometry=VIDEO_GEOMETRY).fps


@pytest.mark.parametrize(
    "item,reason",
    [
        ({"url": "u", "fps": [1]}, r"fps must be a number, got \[1\]"),
        ({"url": "u", "fps": True}, r"fps must be a number, got True"),
        ({"url": "u", "fps": "fast"}, r"fps must be a number, got 'fast'"),
        ({"url": "u", "preprocess_kwargs": {"fps": {"value": 2}}}, r"fps must be a number, got \{'value': 2\}"),
        ({"url": "u", "preprocess_kwargs": "fps=2"}, r"preprocess_kwargs must be an object, got str"),
    ],
)
def test_request_fps_that_is_not_a_number_is_refused_naming_the_video(item, reason):
    """The Engine API passes a video's options as given (over HTTP SGLang's schema gate admits only
    numbers); these escaped as TypeError / AttributeError, a ValueError naming no video, or
    (``True``) were taken as 1 fps."""
    with pytest.raises(MediaError, match=f"^video 2: {reason}$"):
        video_fps(item, "video 2")


def test_request_fps_is_read_where_upstream_reads_it():
    assert video_fps({"url": "u", "fps": 2, "preprocess_kwargs": {"max_frames": 4}}) == 2.0
    assert video_fps({"url": "u", "preprocess_kwargs": {"fps": "0.5"}}) == 0.5
    assert video_fps({"url": "u"}) is None
    assert video_fps("plain-string") is None


@pytest.mark.parametrize("scheme", ["ftp://host/a.png", "s3://bucket/a.png", "gs://bucket/a.png"])
def test_urls_of_other_schemes_are_refused_for_their_scheme(scheme):
    """They were decoded as base64 and refused as "invalid base64 data", which is not what is wrong."""
    with pytest.raises(MediaError, match=rf"^image 2: unsupported URL scheme '{scheme.split(':')[0]}'"):
        read_media(scheme, kind="image", part="image 2", limits=MediaLimits())


def test_url_schemes_are_case_insensitive_and_surrounding_space_is_ignored():
    data = encode_image(random_image(30, 20, seed=13), "PNG")
    encoded = base64.b64encode(data).decode()
    for url in (f"DATA:image/png;base64,{encoded}", f" data:image/png;base64,{encoded}\n"):
        assert read_media(url, kind="image", part="image 1", limits=MediaLimits()).data == data
    with pytest.raises(MediaError, match=r"^image 1: local file paths are disabled"):
        read_media("FILE:///etc/hostname", kind="image", part="image 1", limits=MediaLimits())


def test_exif_orientation_is_left_as_transformers_processor_leaves_it():
    """transformers' M3 processor does not apply EXIF orientation, neither to a PIL image nor to a
    URL it fetches itself (torchvision decoding); only the generic ``load_image`` helper does."""
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to display"
    buffer = io.BytesIO()
    random_image(60, 40, seed=14).save(buffer, "JPEG", exif=exif)
    data = buffer.getvalue()
    url = "data:image/jpeg;base64," + base64.b64encode(data).decode()
    got = ours_image(url)
    assert got.grid_thw == (1, 4, 6)  # 60 wide, 40 high, as stored (rotated would be (1, 6, 4))
    for given in (url, Image.open(io.BytesIO(data))):
        assert_image_matches(got, MiniMaxM3VLImageProcessor()(images=[given], return_tensors="pt"))
