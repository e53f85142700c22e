"""Bad-media corpus: each item is refused with a message naming its part, without a memory spike."""

import asyncio
import base64
import re
import resource

import numpy as np
import pytest

from sglang_m3.multimodal.errors import MediaError
from sglang_m3.multimodal.limits import MediaLimits
from sglang_m3.multimodal.preprocessor import MediaPreprocessor, PreprocessConfig
from sglang_m3.multimodal.pool import MediaWorkerPool
from tests.multimodal.media_factory import (
    encode_image,
    encode_video,
    jpeg_declaring,
    png_declaring,
    random_frames,
    random_image,
)

PNG = encode_image(random_image(64, 48), "PNG")
JPEG = encode_image(random_image(64, 48), "JPEG")
MP4 = encode_video(random_frames(6, 32, 32), 3)


def data_url(mime: str, payload: bytes) -> str:
    return f"data:{mime};base64,{base64.b64encode(payload).decode()}"


def one_hour_video() -> bytes:
    """A real 3600-frame, 1 fps video of 16x16 frames: it declares (and holds) one hour."""
    frames = [np.full((16, 16, 3), i % 251, np.uint8) for i in range(3600)]
    return encode_video(frames, 1)


IMAGE_CORPUS = {
    "truncated JPEG": (JPEG[: len(JPEG) // 2], r"corrupt or truncated"),
    "truncated PNG": (PNG[: len(PNG) // 2], r"corrupt or truncated"),
    "PNG cut inside its header": (PNG[:20], r"corrupt or truncated|not a decodable image"),
    "wrong MIME (text/plain data URL)": (data_url("text/plain", PNG), r"declared MIME type 'text/plain' is not an image"),
    "wrong MIME (video bytes as image)": (data_url("image/png", MP4), r"not a supported image"),
    "zero-byte bytes": (b"", r"media is empty \(0 bytes\)"),
    "zero-byte data URL": ("data:image/png;base64,", r"media is empty \(0 bytes\)"),
    "50k x 50k declared PNG": (png_declaring(50_000, 50_000), r"declared size .*(over the limit|decompression-bomb cap)"),
    "50k x 50k declared JPEG": (jpeg_declaring(50_000, 50_000), r"declared size .*(over the limit|decompression-bomb cap)"),
    "invalid base64": ("data:image/png;base64,@@@@", r"invalid base64"),
    "not base64 and not a URL": ("hello there", r"invalid base64"),
    "random bytes": (bytes(range(256)) * 4, r"not a supported image"),
    "10k x 10k declared PNG (under PIL's cap, over ours)": (
        png_declaring(10_000, 10_000),
        r"declared size 10000x10000 \(100000000 pixels\) is over the limit of 67108864",
    ),
    "local path while disabled": ("/etc/hostname", r"local file paths are disabled"),
}

VIDEO_CORPUS = {
    "1-hour declared video": (one_hour_video(), r"video declares 3600 s, over the limit of 1200 s"),
    "truncated MP4": (MP4[: len(MP4) // 2], r"not a decodable video|corrupt or truncated|no video stream"),
    "zero-byte video": (b"", r"media is empty \(0 bytes\)"),
    "MP4 cut inside its stream description": (MP4[: MP4.index(b"vide") + 4], r"no decodable codec"),
    "image sent as video": (PNG, r"is a PNG image, not a video"),
    "wrong MIME (image/png data URL as video)": (data_url("image/png", MP4), r"declared MIME type 'image/png'"),
    "random bytes as video": (b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 8, r"not a decodable video"),
}


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def refuse(preprocessor: MediaPreprocessor, images=(), videos=()) -> MediaError:
    with pytest.raises(MediaError) as caught:
        asyncio.run(preprocessor.process(list(images), list(videos)))
    return caught.value


@pytest.fixture(scope="module")
def preprocessor():
    pool = MediaWorkerPool(workers=2, max_pending=4)
    yield MediaPreprocessor(PreprocessConfig(), pool)
    pool.shutdown()


@pytest.mark.parametrize("name", sorted(IMAGE_CORPUS))
def test_bad_image_is_refused_naming_the_part(preprocessor, name):
    payload, reason = IMAGE_CORPUS[name]
    error = refuse(preprocessor, images=[PNG, payload])
    assert error.part == "image 2"
    assert str(error).startswith("image 2: ")
    assert re.search(reason, error.reason), error.reason


@pytest.mark.parametrize("name", sorted(VIDEO_CORPUS))
def test_bad_video_is_refused_naming_the_part(preprocessor, name):
    payload, reason = VIDEO_CORPUS[name]
    error = refuse(preprocessor, images=[PNG], videos=[payload])
    assert error.part == "video 1"
    assert re.search(reason, error.reason), error.reason


def test_whole_corpus_stays_small_in_memory(preprocessor):
    """Refusals happen on declared sizes: peak RSS grows by far less than one decoded bomb (7.5 GB)."""
    before = peak_rss_mib()
    for payload, _ in IMAGE_CORPUS.values():
        refuse(preprocessor, images=[payload])
    for payload, _ in VIDEO_CORPUS.values():
        refuse(preprocessor, videos=[payload])
    assert peak_rss_mib() - before < 200


def test_the_good_media_of_the_corpus_pass(preprocessor):
    """The corpus fails for its defects, not because of the good items around them."""
    result = asyncio.run(
        preprocessor.process([PNG, data_url("image/jpeg", JPEG)], [data_url("video/mp4", MP4)])
    )
    assert [f.grid_thw for f in result.images] == [(1, 4, 4), (1, 4, 4)]
    assert result.videos[0].grid_thw[0] == 1


def test_too_many_media_are_refused(preprocessor):
    error = refuse(preprocessor, images=[PNG] * 17)
    assert str(error) == "request: 17 images, over the limit of 16"
    error = refuse(preprocessor, videos=[MP4] * 3)
    assert str(error) == "request: 3 videos, over the limit of 2"


@pytest.mark.parametrize(
    "limits,kind,reason",
    [
        (MediaLimits(max_image_bytes=100), "image", r"media is \d+ bytes, over the limit of 100"),
        (MediaLimits(max_image_pixels=1000), "image", r"declared size 64x48 \(3072 pixels\) is over the limit of 1000"),
        (MediaLimits(max_video_bytes=1000), "video", r"over the limit of 1000"),
        (MediaLimits(max_frame_pixels=1000), "video", r"frame size 32x32 is over the limit of 1000 pixels"),
        (MediaLimits(max_video_seconds=1.0), "video", r"video declares 2 s, over the limit of 1 s"),
        (MediaLimits(max_video_total_pixels=1000), "video", r"2 sampled frames of 56x56 are 6272 pixels"),
    ],
)
def test_limits_are_configurable(limits, kind, reason):
    pool = MediaWorkerPool(workers=1, max_pending=1)
    media = {"images": [PNG]} if kind == "image" else {"videos": [MP4]}
    error = refuse(MediaPreprocessor(PreprocessConfig(limits=limits), pool), **media)
    pool.shutdown()
    assert error.part == f"{kind} 1" and re.search(reason, str(error)), str(error)
