"""Placeholder expansion in text and token-id form, and placeholder runs (property tests)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sglang_m3.multimodal.errors import MediaError
from sglang_m3.multimodal.prompt import MediaTokens, expand_ids, expand_text, placeholder_runs
from tests.multimodal.tiny_vl import tiny_tokenizer

TOKENS = MediaTokens()
TOKENIZER = tiny_tokenizer()
IDS = {"image": TOKENIZER.convert_tokens_to_ids(TOKENS.image), "video": TOKENIZER.convert_tokens_to_ids(TOKENS.video)}


def encode(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


segments = st.lists(
    st.one_of(st.sampled_from(["image", "video"]), st.text(alphabet="ab <>[]]", min_size=0, max_size=6)),
    max_size=8,
)


def build(parts):
    return "".join(TOKENS.image if p == "image" else TOKENS.video if p == "video" else p for p in parts)


def media_texts(parts):
    images = [TOKENS.image_text((1, 2, 2 * (i + 1)), 2) for i in range(parts.count("image"))]
    videos = [TOKENS.video_text((2, 2, 2), 2, [0.0, 2.5 * (i + 1)]) for i in range(parts.count("video"))]
    return images, videos


@given(segments)
def test_text_and_id_expansion_agree(parts):
    text = build(parts)
    images, videos = media_texts(parts)
    expanded = expand_text(text, TOKENS, images, videos)
    assert encode(expanded) == expand_ids(encode(text), IDS, images, videos, encode)


@given(segments)
def test_each_placeholder_gets_its_own_media_in_order(parts):
    images, videos = media_texts(parts)
    ids = encode(expand_text(build(parts), TOKENS, images, videos))
    image_runs = placeholder_runs(ids, IDS["image"])
    assert [end - start + 1 for start, end in image_runs] == [i + 1 for i in range(len(images))]
    assert len(placeholder_runs(ids, IDS["video"])) == 2 * len(videos)


@given(st.lists(st.integers(0, 3), max_size=40), st.integers(0, 3))
def test_runs_cover_exactly_the_token(ids, token):
    runs = placeholder_runs(ids, token)
    covered = {i for start, end in runs for i in range(start, end + 1)}
    assert covered == {i for i, t in enumerate(ids) if t == token}
    assert all(start <= end for start, end in runs)
    assert all(a[1] + 1 < b[0] for a, b in zip(runs, runs[1:]))  # maximal: runs never touch


def test_video_text_has_m3_timestamps():
    assert TOKENS.video_text((2, 2, 4), 2, [0.0, 2.0]) == (
        "]<]0.0 seconds[>[]<]start of image[>[]<]video[>[]<]video[>[]<]end of image[>["
        "]<]2.0 seconds[>[]<]start of image[>[]<]video[>[]<]video[>[]<]end of image[>["
    )


@pytest.mark.parametrize(
    "text,images,videos,message",
    [
        ("no placeholder", 1, 0, "the prompt has 0 image placeholder(s) but the request carries 1 image(s)"),
        (TOKENS.image * 2, 1, 0, "the prompt has 2 image placeholder(s) but the request carries 1 image(s)"),
        (TOKENS.video, 0, 0, "the prompt has 1 video placeholder(s) but the request carries 0 video(s)"),
    ],
)
def test_count_mismatch_is_a_request_error(text, images, videos, message):
    with pytest.raises(MediaError) as caught:
        expand_text(text, TOKENS, ["x"] * images, ["y"] * videos)
    assert str(caught.value) == f"request: {message}"
    with pytest.raises(MediaError):
        expand_ids(encode(text), IDS, ["x"] * images, ["y"] * videos, encode)
