"""Property: any corruption of a valid file either decodes or is refused with a MediaError."""

import asyncio

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_m3.multimodal.errors import MediaError
from sglang_m3.multimodal.limits import MediaLimits
from sglang_m3.multimodal.pool import MediaWorkerPool
from sglang_m3.multimodal.preprocessor import MediaPreprocessor, PreprocessConfig
from sglang_m3.multimodal.sources import read_media
from tests.multimodal.media_factory import encode_image, encode_video, random_frames, random_image

SEEDS = {
    "png": encode_image(random_image(40, 30, seed=1), "PNG"),
    "jpeg": encode_image(random_image(40, 30, seed=2), "JPEG"),
    "gif": encode_image(random_image(40, 30, "P", seed=3), "GIF"),
    "webp": encode_image(random_image(40, 30, seed=4), "WEBP"),
    "mp4": encode_video(random_frames(4, 32, 32), 2),
}
PREPROCESSOR = MediaPreprocessor(PreprocessConfig(limits=MediaLimits(max_video_seconds=30)), MediaWorkerPool(1, 2))


@st.composite
def corrupted(draw):
    name = draw(st.sampled_from(sorted(SEEDS)))
    data = bytearray(SEEDS[name])
    for _ in range(draw(st.integers(0, 8))):
        position = draw(st.integers(0, len(data) - 1))
        data[position] = draw(st.integers(0, 255))
    cut = draw(st.integers(1, len(data)))
    return name, bytes(data[:cut])


def run(images, videos):
    return asyncio.run(PREPROCESSOR.process(images, videos))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(corrupted())
def test_corrupted_media_decodes_or_is_refused_cleanly(sample):
    name, data = sample
    kind_is_video = name == "mp4"
    try:
        result = run([], [data]) if kind_is_video else run([data], [])
    except MediaError as error:
        assert error.part == ("video 1" if kind_is_video else "image 1")
        return
    features = result.videos[0] if kind_is_video else result.images[0]
    t, h, w = features.grid_thw
    assert features.pixel_values.shape == (t * h * w, 3 * 2 * 14 * 14)


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.binary(max_size=64), st.text(max_size=64)))
def test_arbitrary_payloads_never_escape_as_other_errors(payload):
    for kind in ("image", "video"):
        try:
            read_media(payload, kind=kind, part=f"{kind} 1", limits=MediaLimits())
        except MediaError as error:
            assert error.part == f"{kind} 1"
