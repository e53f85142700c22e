"""Second audit against transformers' M3 processor: inputs the other tests do not send.

Image bytes served as ``application/octet-stream``, data URLs without ``;base64``, raster formats
beyond the common six, a URL that trickles its body, and the BOS a tokenizer adds by itself.
Pixels are compared exactly (atol 1e-6 on float32 values that come out bit-identical).
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import shutil
import time
import urllib.parse
from types import SimpleNamespace

import pytest
import torch
from PIL import Image, features
from transformers.models.minimax_m3_vl.image_processing_minimax_m3_vl import MiniMaxM3VLImageProcessor
from transformers.image_utils import load_image_as_tensor
from transformers.video_utils import VideoMetadata

from sglang_m3.multimodal.errors import MediaError
from sglang_m3.multimodal.image import image_features
from sglang_m3.multimodal.limits import MediaLimits
from sglang_m3.multimodal.patches import PatchGeometry
from sglang_m3.multimodal.sources import read_media
from tests.multimodal.media_host import PNG, media_host  # noqa: F401 (media_host: a fixture)
from tests.multimodal.media_factory import decode_all_frames, encode_image, encode_video, random_frames, random_image

HF = MiniMaxM3VLImageProcessor()


def ours(item, limits: MediaLimits = MediaLimits()):
    return image_features(read_media(item, kind="image", part="image 1", limits=limits), PatchGeometry(), limits)


def assert_matches(got, expected) -> None:
    assert [list(got.grid_thw)] == expected["image_grid_thw"].tolist()
    torch.testing.assert_close(got.pixel_values, expected["pixel_values"], rtol=0, atol=1e-6)


def from_pil(data: bytes):
    return HF(images=[Image.open(io.BytesIO(data))], return_tensors="pt")


# --- HTTP ---------------------------------------------------------------------------------------



@pytest.mark.parametrize("path", ["/octet", "/binary-octet"])
def test_images_served_as_octet_stream_are_read_as_transformers_reads_them(media_host, path):
    """Object stores send files uploaded without a type as ``application/octet-stream`` (S3:
    ``binary/octet-stream``); transformers fetches them as images, they were refused for their
    declared type. The content decides (it must still sniff as an image)."""
    url = f"{media_host}{path}"
    expected = HF(images=[load_image_as_tensor(url)], return_tensors="pt")
    assert_matches(ours(url), expected)


@pytest.mark.parametrize("path", ["/gzip", "/chunked"])
def test_compressed_and_chunked_bodies_are_read_whole(media_host, path):
    """The body is read a socket read at a time now (for the deadline): content encoding and
    chunked transfer still come out as the image's bytes."""
    assert read_media(f"{media_host}{path}", kind="image", part="image 1", limits=MediaLimits()).data == PNG


def test_a_url_whose_body_trickles_is_cut_at_the_timeout_naming_the_image(media_host):
    """Each byte arrived within the read timeout, so the fetch never timed out: a body sent one
    byte at a time held the request (and a media worker) for hours. ``url_timeout_s`` bounds the
    whole fetch now."""
    started = time.monotonic()
    with pytest.raises(MediaError, match=r"^image 1: fetching http://.*/drip took longer than 1 s"):
        ours(f"{media_host}/drip", MediaLimits(url_timeout_s=1.0))
    assert time.monotonic() - started < 30  # cut at 1 s; the margin is for a busy machine (unfixed, it never ended)


# --- data URLs ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "data:image/png," + urllib.parse.quote_from_bytes(PNG),
        "data:," + urllib.parse.quote_from_bytes(PNG),
        "data:image/png;charset=binary," + urllib.parse.quote_from_bytes(PNG),
    ],
    ids=["percent-encoded", "percent-encoded without a type", "percent-encoded with a parameter"],
)
def test_data_urls_without_base64_are_percent_decoded(url):
    """RFC 2397: without ``;base64`` a data URL's data are percent-encoded octets. They were
    refused ("data URL must be 'data:<mime>;base64,<data>'")."""
    assert read_media(url, kind="image", part="image 1", limits=MediaLimits()).data == PNG
    assert_matches(ours(url), from_pil(PNG))


def test_a_data_url_holding_base64_without_the_marker_is_read_as_transformers_reads_it():
    """transformers decodes whatever follows the comma as base64; clients that leave out
    ``;base64`` got a 400 here."""
    url = "data:image/png," + base64.b64encode(PNG).decode()
    assert_matches(ours(url), HF(images=[url], return_tensors="pt"))


def test_a_percent_encoded_base64_data_url_is_read():
    """A data URL is a URL: clients that URL-encode it whole send ``+``, ``/`` and ``=`` of its
    base64 as ``%2B``, ``%2F``, ``%3D``; they were refused as invalid base64."""
    encoded = base64.b64encode(PNG).decode()
    assert "+" in encoded or "/" in encoded or "=" in encoded
    url = "data:image/png;base64," + urllib.parse.quote(encoded, safe="")
    assert read_media(url, kind="image", part="image 1", limits=MediaLimits()).data == PNG


def test_a_data_url_that_is_neither_base64_nor_an_image_names_the_image():
    with pytest.raises(MediaError, match=r"^image 1: content is not a supported image"):
        ours("data:image/png,hello%20there")
    with pytest.raises(MediaError, match=r"^image 1: invalid percent-encoding in the data URL"):
        ours("data:image/png,%89PNG%zz")


# --- formats ------------------------------------------------------------------------------------

FORMATS = ["AVIF", "JPEG2000", "ICO", "PPM", "QOI"]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L"])
def test_more_raster_formats_match_transformers(fmt, mode):
    """transformers' processor takes any image PIL opens; AVIF (what browsers and phones now
    save), JPEG 2000, ICO, PPM and QOI were refused as "not a supported image"."""
    if fmt == "AVIF" and not features.check("avif"):
        pytest.skip("this Pillow has no AVIF codec")
    image = random_image(61, 37, mode, seed=len(fmt))
    if (fmt, mode) in (("PPM", "RGBA"), ("QOI", "L")):  # modes these formats cannot store
        image = image.convert("RGB")
    data = encode_image(image, fmt)
    assert_matches(ours(data), from_pil(data))
    url = "data:application/octet-stream;base64," + base64.b64encode(data).decode()
    assert_matches(ours(url), from_pil(data))


def test_formats_that_run_external_programs_stay_refused():
    """EPS would be rendered by Ghostscript, a separate program: never opened."""
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n"
    with pytest.raises(MediaError, match=r"^image 1: content is not a supported image"):
        ours(eps)


# --- tokenization -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bos_checkpoint(tiny_m3_vl_checkpoint, tmp_path_factory):
    """The tiny VL checkpoint with a tokenizer that adds its BOS to every encoding by itself."""
    target = str(tmp_path_factory.mktemp("bos") / "tiny-vl-bos")
    shutil.copytree(tiny_m3_vl_checkpoint, target)
    path = os.path.join(target, "tokenizer.json")
    with open(path, encoding="utf-8") as handle:
        spec = json.load(handle)
    bos = "]~!b["
    bos_id = next(token["id"] for token in spec["added_tokens"] if token["content"] == bos)
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}},
    }
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(spec, handle)
    return target


@pytest.fixture(scope="module")
def bos_processors(bos_checkpoint):
    from sglang.srt.runtime_context import create_context, use_context
    from sglang.srt.server_args import ServerArgs
    from transformers import AutoConfig, AutoProcessor

    from sglang_m3.multimodal.sglang_processor import MiniMaxM3MultimodalProcessor

    server_args = ServerArgs(model_path=bos_checkpoint, device="cpu", dtype="float32")
    hf_processor = AutoProcessor.from_pretrained(bos_checkpoint)
    with use_context(create_context(server_args, role="tokenizer")):
        processor = MiniMaxM3MultimodalProcessor(AutoConfig.from_pretrained(bos_checkpoint), server_args, hf_processor, None)
        yield processor, hf_processor
        processor.shutdown()


def test_a_tokenizer_that_adds_bos_gets_it_once_as_sglang_and_transformers_add_it(bos_processors):
    """SGLang tokenizes a raw ``/generate`` prompt with the tokenizer's own special tokens, and
    transformers' processor does too; with an image the expanded prompt was encoded without
    them, so the same prompt began with BOS without an image and without BOS with one. A prompt
    that already starts with BOS (the chat template's) gets none added, as upstream SGLang's guard
    and transformers' chat path do."""
    processor, hf_processor = bos_processors
    bos_id = hf_processor.tokenizer.convert_tokens_to_ids("]~!b[")
    request = SimpleNamespace(video_data=None)
    for prompt, add in [("Describe ]<]image[>[ briefly.", True), ("]~!b[]~b]user\n]<]image[>[[e~[\n]~b]ai\n", False)]:
        got = asyncio.run(processor.process_mm_data_async([PNG], None, prompt, request)).input_ids
        expected = hf_processor(text=[prompt], images=[Image.open(io.BytesIO(PNG))], add_special_tokens=add)
        assert got == expected["input_ids"][0]
        assert got[0] == bos_id and got[1] != bos_id


# --- request-level processor kwargs -------------------------------------------------------------

VIDEO = encode_video(random_frames(12, 64, 40, seed=22), 4)
IMAGE = encode_image(random_image(300, 200, seed=23), "PNG")


@pytest.fixture(scope="module")
def vl_processors(tiny_m3_vl_checkpoint):
    from sglang.srt.runtime_context import create_context, use_context
    from sglang.srt.server_args import ServerArgs
    from transformers import AutoConfig, AutoProcessor

    from sglang_m3.multimodal.sglang_processor import MiniMaxM3MultimodalProcessor

    server_args = ServerArgs(model_path=tiny_m3_vl_checkpoint, device="cpu", dtype="float32")
    hf_processor = AutoProcessor.from_pretrained(tiny_m3_vl_checkpoint)
    with use_context(create_context(server_args, role="tokenizer")):
        processor = MiniMaxM3MultimodalProcessor(
            AutoConfig.from_pretrained(tiny_m3_vl_checkpoint), server_args, hf_processor, None
        )
        yield processor, hf_processor
        processor.shutdown()


def served(processor, prompt, images, videos, mm_processor_kwargs):
    request = SimpleNamespace(video_data=videos, mm_processor_kwargs=mm_processor_kwargs)
    return asyncio.run(processor.process_mm_data_async(images, None, prompt, request))


def transformers_with(hf_processor, prompt, kwargs):
    """transformers' processor called with ``kwargs`` as a caller passes them (flat ones reach
    every modality that takes them), on the test's image and video sampled at ``fps``."""
    kwargs = json.loads(json.dumps(kwargs))  # the caller's dict stays as sent
    videos_kwargs = kwargs.pop("videos_kwargs", {})
    frames, native = decode_all_frames(VIDEO)
    metadata = VideoMetadata(total_num_frames=len(frames), fps=native, height=frames.shape[1], width=frames.shape[2])
    videos_kwargs = {"do_resize": True, "do_sample_frames": True, "fps": 1.0, "video_metadata": [metadata], **videos_kwargs}
    if "fps" in kwargs:
        videos_kwargs["fps"] = kwargs.pop("fps")
    return hf_processor(
        text=[prompt], images=[Image.open(io.BytesIO(IMAGE))], videos=[frames], videos_kwargs=videos_kwargs,
        return_tensors="pt", add_special_tokens=False, **kwargs,
    )


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_pixels": 28 * 28 * 20},
        {"min_pixels": 28 * 28 * 300, "fps": 2.0},
        {"images_kwargs": {"max_pixels": 28 * 28 * 6}, "videos_kwargs": {"min_pixels": 28 * 28 * 30, "fps": 0.5}},
    ],
    ids=["flat max_pixels", "flat min_pixels and fps", "per-modality"],
)
def test_request_mm_processor_kwargs_match_transformers_called_with_them(vl_processors, kwargs):
    """SGLang hands a chat or ``/generate`` request's ``mm_processor_kwargs`` to the processor;
    they were ignored without a word, so the request got other grids and token counts than
    transformers' processor called with the same kwargs."""
    processor, hf_processor = vl_processors
    prompt = "]~!b[]~b]user\nCompare ]<]image[>[ and ]<]video[>[[e~[\n]~b]ai\n"
    output = served(processor, prompt, [IMAGE], [VIDEO], kwargs)
    expected = transformers_with(hf_processor, prompt, kwargs)
    image_item, video_item = output.mm_items
    assert image_item.image_grid_thw.tolist() == expected["image_grid_thw"].tolist()
    assert video_item.video_grid_thw.tolist() == expected["video_grid_thw"].tolist()
    assert output.input_ids == expected["input_ids"][0].tolist()
    torch.testing.assert_close(image_item.feature, expected["pixel_values"], rtol=0, atol=1e-6)
    torch.testing.assert_close(video_item.feature, expected["pixel_values_videos"], rtol=0, atol=1e-6)
    baseline = served(processor, prompt, [IMAGE], [VIDEO], None)
    assert baseline.input_ids != output.input_ids  # the kwargs took effect


def test_an_item_option_wins_over_the_request_kwargs(vl_processors):
    processor, _ = vl_processors
    item = {"url": "data:image/png;base64," + base64.b64encode(IMAGE).decode(), "max_pixels": 28 * 28 * 4}
    output = served(processor, "]<]image[>[", [item], None, {"max_pixels": 28 * 28 * 100})
    assert output.mm_items[0].image_grid_thw.tolist() == [[1, 2, 4]]  # 56x28: smart_resize under 4 blocks


@pytest.mark.parametrize(
    "kwargs,reason",
    [
        ("max_pixels=5", r"must be an object, got str"),
        ({"max_slice_nums": 9}, r"max_slice_nums is not a media option; images take min_pixels, "
                                r"max_pixels; videos take min_pixels, max_pixels, fps, max_frames"),
        ({"images_kwargs": {"fps": 2}}, r"images_kwargs\.fps is a video option; images take"),
        ({"images_kwargs": {"num_frames": 2}}, r"images_kwargs\.num_frames is not a media option; images take"),
        ({"videos_kwargs": [1]}, r"videos_kwargs must be an object, got list"),
        ({"max_long_side_pixel": 512}, r"max_long_side_pixel is not supported for MiniMax M3 media"),
        ({"max_pixels": 10**9}, r"max_pixels 1000000000 is over the server's max_pixels 451584"),
        ({"min_pixels": 0}, r"min_pixels must be a positive integer, got 0"),
        ({"fps": "fast"}, r"fps must be a number, got 'fast'"),
    ],
)
def test_request_kwargs_that_cannot_be_honoured_are_refused_by_name(vl_processors, kwargs, reason):
    processor, _ = vl_processors
    with pytest.raises(MediaError, match=rf"^mm_processor_kwargs: {reason}"):
        served(processor, "]<]image[>[ ]<]video[>[", [IMAGE], [VIDEO], kwargs)


def test_request_kwargs_for_a_kind_the_request_does_not_carry_are_not_checked(vl_processors):
    """As in transformers, a flat option reaches the modalities that take it; a video-only bound
    that the image ceiling would refuse does not fail a request without images."""
    processor, _ = vl_processors
    output = served(processor, "]<]video[>[", None, [VIDEO], {"max_pixels": 28 * 28 * 700})
    assert len(output.mm_items) == 1


# --- animated GIF as a video --------------------------------------------------------------------


def animated_gif(count: int = 7, duration_ms: int = 250) -> bytes:
    frames = [random_image(70, 44, seed=60 + i) for i in range(count)]
    buffer = io.BytesIO()
    frames[0].save(buffer, "GIF", save_all=True, append_images=frames[1:], duration=duration_ms, loop=0)
    return buffer.getvalue()


@pytest.mark.parametrize("mime", ["image/gif", "video/gif"])
def test_an_animated_gif_sent_as_a_video_matches_transformers(mime):
    """transformers' PyAV video reader decodes an animated GIF like any video; a GIF in a video
    part was refused ("content is a GIF image, not a video")."""
    from transformers.models.minimax_m3_vl.video_processing_minimax_m3_vl import MiniMaxM3VLVideoProcessor

    from sglang_m3.multimodal.preprocessor import VIDEO_GEOMETRY
    from sglang_m3.multimodal.video import video_features

    data = animated_gif()
    url = f"data:{mime};base64," + base64.b64encode(data).decode()
    limits = MediaLimits()
    got = video_features(read_media(url, kind="video", part="video 1", limits=limits), VIDEO_GEOMETRY, limits, 2.0)
    frames, native = decode_all_frames(data)
    metadata = VideoMetadata(total_num_frames=len(frames), fps=native, height=frames.shape[1], width=frames.shape[2])
    expected = MiniMaxM3VLVideoProcessor()(
        videos=[frames], video_metadata=[metadata], do_sample_frames=True, fps=2.0, return_metadata=True, return_tensors="pt"
    )
    assert [list(got.grid_thw)] == expected["video_grid_thw"].tolist()
    assert got.frame_indices == list(expected["video_metadata"][0].frames_indices)
    torch.testing.assert_close(got.pixel_values, expected["pixel_values_videos"], rtol=0, atol=1e-6)


def test_still_images_sent_as_a_video_stay_refused():
    with pytest.raises(MediaError, match=r"^video 1: content is a PNG image, not a video"):
        read_media(PNG, kind="video", part="video 1", limits=MediaLimits())
