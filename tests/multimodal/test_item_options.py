"""Per-item media options (``min_pixels``, ``max_pixels``, ``fps``, ``max_frames``) are honoured as
transformers' M3 processors honour them per call, or refused naming the option and the item.

They were accepted and silently ignored: a caller who asked for a smaller image or fewer frames got
the server's defaults and believed the options had taken effect. Options reach the processor as a
dict item's own keys (``/generate``), in ``preprocess_kwargs`` (SGLang's chat layer puts a
``video_url``'s ``fps`` / ``max_frames`` there) or on an ``ImageData`` / ``VideoData``.
"""

from __future__ import annotations

import asyncio
import base64
import io

import pytest
import torch
from PIL import Image
from sglang.srt.utils import ImageData, VideoData
from transformers.models.minimax_m3_vl import MiniMaxM3VLImageProcessor, MiniMaxM3VLProcessor, MiniMaxM3VLVideoProcessor
from transformers.video_utils import VideoMetadata, default_sample_indices_fn

from sglang_m3.multimodal.errors import MediaError
from sglang_m3.multimodal.limits import MediaLimits
from sglang_m3.multimodal.options import item_options
from sglang_m3.multimodal.pool import MediaWorkerPool
from sglang_m3.multimodal.preprocessor import VIDEO_GEOMETRY, MediaPreprocessor, PreprocessConfig
from tests.multimodal.media_factory import decode_all_frames, encode_image, encode_video, random_frames, random_image
from tests.multimodal.tiny_vl import tiny_tokenizer

IMAGE = encode_image(random_image(640, 480, seed=31), "PNG")
SMALL_IMAGE = encode_image(random_image(100, 80, seed=32), "PNG")
VIDEO = encode_video(random_frames(12, 200, 120, seed=33), 4)
REFERENCE = MiniMaxM3VLProcessor(
    image_processor=MiniMaxM3VLImageProcessor(), tokenizer=tiny_tokenizer(), video_processor=MiniMaxM3VLVideoProcessor()
)
NEVER_READ = "ftp://never/read"  # a source refused as "unsupported URL scheme" if it were ever read


def data_url(mime: str, payload: bytes) -> str:
    return f"data:{mime};base64,{base64.b64encode(payload).decode()}"


def preprocess(images=(), videos=(), config: PreprocessConfig = PreprocessConfig()):
    pool = MediaWorkerPool(workers=1, max_pending=2)
    try:
        return asyncio.run(MediaPreprocessor(config, pool).process(list(images), list(videos)))
    finally:
        pool.shutdown()


def carried(kind: str, url: str, options: dict, form: str):
    """One item carrying ``options`` in each place SGLang hands them on."""
    if form == "dict":
        return {"url": url, **options}
    if form == "preprocess_kwargs":
        return {"url": url, "preprocess_kwargs": options}
    data_class = ImageData if kind == "image" else VideoData
    return data_class(url=url, preprocess_kwargs=options)


def reference_image(data: bytes, options: dict):
    """transformers' processor with the item's bounds, in the ``size`` form it asks for (its per-call
    ``min_pixels`` / ``max_pixels`` are the deprecated spelling of the same two edges)."""
    size = dict(REFERENCE.image_processor.size)
    size.update({edge: options[key] for key, edge in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")) if key in options})
    image = Image.open(io.BytesIO(data))
    return REFERENCE(text=["]<]image[>["], images=[image], images_kwargs={"size": size}, return_tensors="pt")


@pytest.mark.parametrize("form", ["dict", "preprocess_kwargs", "ImageData"])
@pytest.mark.parametrize(
    "data,options",
    [
        pytest.param(IMAGE, {"max_pixels": 28 * 28 * 30}, id="max shrinks"),
        pytest.param(SMALL_IMAGE, {"min_pixels": 28 * 28 * 40}, id="min grows"),
        pytest.param(IMAGE, {"min_pixels": 28 * 28 * 8, "max_pixels": 28 * 28 * 12}, id="both"),
        pytest.param(SMALL_IMAGE, {"min_pixels": 1, "max_pixels": 28 * 28}, id="one merged patch"),
    ],
)
def test_image_pixel_bounds_match_transformers_called_with_them(data, options, form):
    got = preprocess(images=[carried("image", data_url("image/png", data), options, form)])
    expected = reference_image(data, options)
    default = preprocess(images=[data]).images[0]
    assert [list(got.images[0].grid_thw)] == expected["image_grid_thw"].tolist() != [list(default.grid_thw)]
    torch.testing.assert_close(got.images[0].pixel_values, expected["pixel_values"], rtol=0, atol=1e-6)
    image_token = REFERENCE.tokenizer.convert_tokens_to_ids("]<]image[>[")
    assert got.image_texts[0].count("]<]image[>[") == int((expected["input_ids"] == image_token).sum())


def video_metadata(data: bytes):
    frames, native = decode_all_frames(data)
    return frames, VideoMetadata(total_num_frames=len(frames), fps=native, height=frames.shape[1], width=frames.shape[2])


def assert_video_matches(got, expected) -> None:
    """Frames, grid, patch rows and the prompt text (timestamps and token counts) all agree."""
    video = got.videos[0]
    assert video.frame_indices == list(expected["video_metadata"][0].frames_indices)
    assert [list(video.grid_thw)] == expected["video_grid_thw"].tolist()
    torch.testing.assert_close(video.pixel_values, expected["pixel_values_videos"], rtol=0, atol=1e-6)
    assert got.video_texts[0] == REFERENCE.replace_video_token(expected, 0)


@pytest.mark.parametrize("form", ["dict", "preprocess_kwargs", "VideoData"])
@pytest.mark.parametrize(
    "options",
    [
        {"min_pixels": 28 * 28 * 60},
        {"max_pixels": 28 * 28 * 6, "fps": 2.0},
        {"min_pixels": 28 * 28 * 10, "max_pixels": 28 * 28 * 20, "fps": 3},
    ],
)
def test_video_pixel_bounds_and_rate_match_transformers_called_with_them(options, form):
    got = preprocess(videos=[carried("video", data_url("video/mp4", VIDEO), options, form)])
    frames, metadata = video_metadata(VIDEO)
    expected = REFERENCE.video_processor(
        videos=[frames],
        video_metadata=[metadata],
        do_sample_frames=True,
        return_metadata=True,
        return_tensors="pt",
        **{"fps": 1.0, **options},
    )
    assert_video_matches(got, expected)
    assert got.videos[0].grid_thw != preprocess(videos=[VIDEO]).videos[0].grid_thw


@pytest.mark.parametrize("form", ["dict", "preprocess_kwargs", "VideoData"])
def test_a_video_frame_cap_samples_as_transformers_uniform_sampler(form):
    """transformers' M3 video processor takes ``max_frames`` but its sampler never reads it, so the
    oracle is its uniform sampler asked for the capped count (as for the server's own cap)."""
    options = {"fps": 4.0, "max_frames": 5, "max_pixels": 28 * 28 * 8}
    got = preprocess(videos=[carried("video", data_url("video/mp4", VIDEO), options, form)])
    frames, metadata = video_metadata(VIDEO)
    indices = default_sample_indices_fn(metadata, num_frames=5)
    expected = REFERENCE.video_processor(
        videos=[frames[indices]], do_sample_frames=False, max_pixels=options["max_pixels"], return_tensors="pt"
    )
    metadata.frames_indices = indices
    expected["video_metadata"] = [metadata]
    assert list(indices) == [0, 2, 4, 7, 9]
    assert_video_matches(got, expected)


def test_the_server_frame_cap_still_bounds_an_item_asking_for_more():
    """``max_frames`` asks for at most that many frames; the server's ``max_video_frames`` stays the ceiling."""
    config = PreprocessConfig(limits=MediaLimits(max_video_frames=3))
    got = preprocess(videos=[{"url": data_url("video/mp4", VIDEO), "fps": 4.0, "max_frames": 8}], config=config)
    assert got.videos[0].frame_indices == [0, 4, 8]


@pytest.mark.parametrize(
    "kind,item,reason",
    [
        ("image", {"max_pixels": 0}, r"max_pixels must be a positive integer, got 0"),
        ("image", {"min_pixels": -3136}, r"min_pixels must be a positive integer, got -3136"),
        ("image", {"max_pixels": "big"}, r"max_pixels must be a positive integer, got 'big'"),
        ("image", {"min_pixels": True}, r"min_pixels must be a positive integer, got True"),
        ("image", {"max_pixels": 1500.5}, r"max_pixels must be a positive integer, got 1500\.5"),
        ("video", {"preprocess_kwargs": {"max_frames": 0}}, r"max_frames must be a positive integer, got 0"),
        ("video", {"max_frames": [4]}, r"max_frames must be a positive integer, got \[4\]"),
        ("video", {"fps": "fast"}, r"fps must be a number, got 'fast'"),
        ("image", {"min_pixels": 20000, "max_pixels": 10000}, r"min_pixels 20000 is over max_pixels 10000"),
        ("image", {"min_pixels": 500000}, r"min_pixels 500000 is over the server's max_pixels 451584"),
        ("image", {"max_pixels": 784}, r"max_pixels 784 is under the server's min_pixels 3136; send min_pixels as well"),
        ("image", {"max_pixels": 10**7}, r"max_pixels 10000000 is over the server's max_pixels 451584"),
        ("video", {"max_pixels": 10**7}, r"max_pixels 10000000 is over the server's max_pixels 602112"),
        ("image", {"fps": 2}, r"fps is a video option; images take min_pixels, max_pixels"),
        ("image", {"preprocess_kwargs": {"max_frames": 4}}, r"max_frames is a video option; images take min_pixels, max_pixels"),
        ("image", {"max_long_side_pixel": 896}, r"max_long_side_pixel is not supported for MiniMax M3 media; use min_pixels / max_pixels"),
        ("video", {"preprocess_kwargs": {"max_tokens_per_frame": 64}}, r"max_tokens_per_frame is not supported .*use min_pixels / max_pixels"),
        ("video", {"preprocess_kwargs": {"max_dynamic_patch": 6}}, r"max_dynamic_patch is not supported .*use min_pixels / max_pixels"),
        ("image", {"preprocess_kwargs": {"resize": False}}, r"preprocess_kwargs\.resize is not a media option; images take min_pixels, max_pixels"),
        (
            "video",
            {"preprocess_kwargs": {"use_audio": True}},
            r"preprocess_kwargs\.use_audio is not a media option; videos take min_pixels, max_pixels, fps, max_frames",
        ),
        ("image", {"preprocess_kwargs": "max_pixels=1"}, r"preprocess_kwargs must be an object, got str"),
        ("video", {"fps": 2, "preprocess_kwargs": {"fps": 4}}, r"fps is given twice with different values \(2 and 4\)"),
    ],
)
def test_bad_options_are_refused_naming_the_option_and_item_before_any_media_is_read(kind, item, reason):
    good = data_url("image/png", SMALL_IMAGE) if kind == "image" else data_url("video/mp4", VIDEO)
    items = [good, {"url": NEVER_READ, **item}]
    media = {"images": items} if kind == "image" else {"videos": items}
    with pytest.raises(MediaError, match=f"^{kind} 2: {reason}$"):
        preprocess(**media)


@pytest.mark.parametrize(
    "item,reason",
    [
        (ImageData(url=NEVER_READ, max_long_side_pixel=896), r"image 1: max_long_side_pixel is not supported"),
        (ImageData(url=NEVER_READ, max_dynamic_patch=4), r"image 1: max_dynamic_patch is not supported"),
        (ImageData(url=NEVER_READ, preprocess_kwargs={"max_pixels": -1}), r"image 1: max_pixels must be a positive integer"),
    ],
)
def test_options_on_sglang_image_data_are_read(item, reason):
    with pytest.raises(MediaError, match=f"^{reason}"):
        preprocess(images=[item])


def test_options_on_sglang_video_data_are_read():
    with pytest.raises(MediaError, match=r"^video 1: max_long_side_pixel is not supported"):
        preprocess(videos=[VideoData(url=NEVER_READ, max_long_side_pixel=896)])


def test_integral_floats_count_as_integers():
    """JSON writers of some languages send ``3136.0`` for an integer."""
    item = {"url": NEVER_READ, "max_pixels": 23520.0, "max_frames": 4.0}
    options = item_options(item, kind="video", part="video 1", geometry=VIDEO_GEOMETRY)
    assert (options.geometry.max_pixels, options.max_frames) == (23520, 4)


def test_items_without_options_keep_the_server_settings():
    plain = preprocess(images=[IMAGE], videos=[VIDEO])
    chat_shaped = preprocess(
        images=[ImageData(url=data_url("image/png", IMAGE))], videos=[VideoData(url=data_url("video/mp4", VIDEO))]
    )
    assert plain.image_texts == chat_shaped.image_texts and plain.video_texts == chat_shaped.video_texts
    assert torch.equal(plain.images[0].pixel_values, chat_shaped.images[0].pixel_values)
