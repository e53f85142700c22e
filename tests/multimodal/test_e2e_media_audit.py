"""The served tiny VL model against transformers' processor and model on inputs the other served
tests do not send: odd image sizes, modes and formats, few-frame videos, an animated GIF as a
video, media in every turn with ``detail``, data URLs without base64, request-level
``mm_processor_kwargs``, and URLs that fail.

One server (``url_timeout_s`` 3 s) serves every test here; transformers is the oracle for the prompt
token ids after expansion and for the greedy tokens.
"""

from __future__ import annotations

import base64
import io
import re
import socket
import time
import urllib.parse

import numpy as np
import pytest
import requests
from PIL import Image, features
from server_harness import launch_cpu_server
from transformers import AutoProcessor
from transformers.video_utils import VideoMetadata

from sglang_m3.multimodal.sglang_processor import PACKAGE_ENV
from tests.multimodal.media_factory import decode_all_frames, encode_image, encode_video, random_frames, random_image
from tests.multimodal.media_host import PNG, media_host  # noqa: F401 (media_host: a fixture)
from tests.multimodal.vl_oracle import NEW_TOKENS, data_url, oracle_tokens


def _project_serves_vl() -> bool:
    from sglang.srt.models.registry import import_model_classes

    return "MiniMaxM3SparseForConditionalGeneration" in import_model_classes("sglang_m3.models", strict=True)


pytestmark = [
    pytest.mark.server,
    pytest.mark.skipif(not _project_serves_vl(), reason="sglang_m3.models has no VL model class yet"),
]

URL_TIMEOUT_S = 3


def exif_jpeg() -> bytes:
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 CW to display: transformers' processor does not rotate
    buffer = io.BytesIO()
    random_image(60, 40, seed=41).save(buffer, "JPEG", exif=exif)
    return buffer.getvalue()


def sixteen_bit_png() -> bytes:
    rng = np.random.default_rng(42)
    return encode_image(Image.fromarray(rng.integers(0, 65536, (33, 47)).astype(np.uint16)), "PNG")


ODD_IMAGES = {
    "1x1": encode_image(random_image(1, 1, seed=43), "PNG"),
    "1x199": encode_image(random_image(1, 199, seed=44), "PNG"),
    "RGBA 61x150": encode_image(random_image(61, 150, "RGBA", seed=45), "PNG"),
    "P with transparency": encode_image(random_image(50, 30, "P", seed=46), "PNG"),
    "LA": encode_image(random_image(33, 70, "LA", seed=47), "PNG"),
    "CMYK JPEG": encode_image(random_image(90, 57, "CMYK", seed=48), "JPEG"),
    "16-bit grey PNG": sixteen_bit_png(),
    "EXIF-rotated JPEG": exif_jpeg(),
    "999x29": encode_image(random_image(999, 29, seed=49), "PNG"),
}
if features.check("avif"):
    ODD_IMAGES["AVIF"] = encode_image(random_image(64, 40, seed=50), "AVIF")

ONE_FRAME = encode_video(random_frames(1, 70, 45, seed=51), 1, codec="png", fmt="mov", pix_fmt="rgb24")
THREE_FRAMES = encode_video(random_frames(3, 57, 33, seed=52), 1, codec="png", fmt="mov", pix_fmt="rgb24")




@pytest.fixture(scope="module")
def server(tiny_m3_vl_checkpoint, server_log_dir):
    config = f'{{"limits": {{"url_timeout_s": {URL_TIMEOUT_S}}}}}'
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv(PACKAGE_ENV, raising=False)
        with launch_cpu_server(tiny_m3_vl_checkpoint, server_log_dir, "--mm-process-config", config) as running:
            yield running


@pytest.fixture(scope="module")
def hf_processor(tiny_m3_vl_checkpoint):
    return AutoProcessor.from_pretrained(tiny_m3_vl_checkpoint)


def video_inputs(videos: list[bytes], fps: float = 1.0) -> dict:
    decoded = [decode_all_frames(video) for video in videos]
    metadata = [VideoMetadata(total_num_frames=len(f), fps=n, height=f.shape[1], width=f.shape[2]) for f, n in decoded]
    return {
        "videos": [f for f, _ in decoded],
        "videos_kwargs": {"do_resize": True, "do_sample_frames": True, "fps": fps, "video_metadata": metadata},
    }


def reference(hf_processor, prompt: str, images=(), videos=(), **kwargs):
    """transformers' processor on ``prompt`` and the media (PIL images, PyAV frames)."""
    media = video_inputs(list(videos), kwargs.pop("fps", 1.0)) if videos else {}
    if "videos_kwargs" in kwargs:
        media["videos_kwargs"].update(kwargs.pop("videos_kwargs"))
    if images:
        media["images"] = [Image.open(io.BytesIO(data)) for data in images]
    return hf_processor(text=[prompt], return_tensors="pt", add_special_tokens=False, **media, **kwargs)


def chat(server, messages, **extra):
    body = {
        "model": "default",
        "messages": messages,
        "max_tokens": NEW_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }
    return requests.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=600)


def generate(server, prompt: str, images=(), videos=(), **extra):
    body = {
        "text": prompt,
        "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True},
        "return_logprob": True,
        **extra,
    }
    if images:
        body["image_data"] = list(images)
    if videos:
        body["video_data"] = list(videos)
    return requests.post(f"{server.base_url}/generate", json=body, timeout=600)


def image_part(data: bytes, **fields) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url("image/png", data), **fields}}


def template_messages(messages: list[dict]) -> list[dict]:
    """The messages as the chat template sees them (SGLang turns media parts into bare types)."""
    def part(p):
        return p if p["type"] == "text" else {"type": p["type"].removesuffix("_url")}

    return [{**m, "content": m["content"] if isinstance(m["content"], str) else [part(p) for p in m["content"]]} for m in messages]


def test_chat_media_in_every_turn_with_detail_match_transformers(server, hf_processor, tiny_m3_vl_checkpoint):
    """Several images in one message, images in the system, assistant and tool turns, ``detail``
    (which M3 has no setting for, and which transformers does not read), a 1-frame and a 3-frame
    video: the expanded prompt ids and the greedy tokens equal transformers'."""
    odd = ODD_IMAGES
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "Reference:"}, image_part(odd["RGBA 61x150"], detail="high")]},
        {
            "role": "user",
            "content": [
                image_part(odd["1x1"], detail="low"),
                image_part(odd["P with transparency"]),
                {"type": "text", "text": "and"},
                {"type": "video_url", "video_url": {"url": data_url("video/quicktime", ONE_FRAME)}},
                image_part(odd["1x199"], detail="auto"),
            ],
        },
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "Like"}, image_part(odd["LA"])],
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "look", "arguments": {"at": "it"}}}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": [image_part(odd["CMYK JPEG"]), {"type": "text", "text": "done"}]},
        {"role": "user", "content": [{"type": "video_url", "video_url": {"url": data_url("video/quicktime", THREE_FRAMES)}}, {"type": "text", "text": "Now?"}]},
    ]
    response = chat(server, messages)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    prompt = hf_processor.tokenizer.apply_chat_template(template_messages(messages), tokenize=False, add_generation_prompt=True)
    images = [odd[name] for name in ("RGBA 61x150", "1x1", "P with transparency", "1x199", "LA", "CMYK JPEG")]
    expected = reference(hf_processor, prompt, images, [ONE_FRAME, THREE_FRAMES])
    assert choice["prompt_token_ids"] == expected["input_ids"][0].tolist()
    assert choice["response_token_ids"] == oracle_tokens(tiny_m3_vl_checkpoint, expected)


@pytest.mark.parametrize("name", sorted(ODD_IMAGES))
def test_odd_images_are_served_as_transformers_sees_them(server, hf_processor, tiny_m3_vl_checkpoint, name):
    prompt = "Describe ]<]image[>[ briefly."
    response = generate(server, prompt, [data_url("image/png", ODD_IMAGES[name])])
    assert response.status_code == 200, response.text
    expected = reference(hf_processor, prompt, [ODD_IMAGES[name]])
    result = response.json()
    assert result["meta_info"]["prompt_tokens"] == expected["input_ids"].shape[1]
    assert [t[1] for t in result["meta_info"]["output_token_logprobs"]] == oracle_tokens(tiny_m3_vl_checkpoint, expected)


def test_two_few_frame_videos_in_one_request(server, hf_processor, tiny_m3_vl_checkpoint):
    prompt = "First ]<]video[>[ then ]<]video[>[ compare."
    response = generate(server, prompt, videos=[data_url("video/quicktime", v) for v in (THREE_FRAMES, ONE_FRAME)])
    assert response.status_code == 200, response.text
    expected = reference(hf_processor, prompt, videos=[THREE_FRAMES, ONE_FRAME])
    result = response.json()
    assert result["meta_info"]["prompt_tokens"] == expected["input_ids"].shape[1]
    assert [t[1] for t in result["meta_info"]["output_token_logprobs"]] == oracle_tokens(tiny_m3_vl_checkpoint, expected)


def test_an_animated_gif_in_a_video_part_is_served_as_transformers_reads_it(server, hf_processor, tiny_m3_vl_checkpoint):
    frames = [random_image(70, 44, seed=55 + i) for i in range(5)]
    buffer = io.BytesIO()
    frames[0].save(buffer, "GIF", save_all=True, append_images=frames[1:], duration=400, loop=0)
    gif = buffer.getvalue()
    messages = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": data_url("image/gif", gif)}}, {"type": "text", "text": "?"}]}]
    response = chat(server, messages)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    prompt = hf_processor.tokenizer.apply_chat_template(template_messages(messages), tokenize=False, add_generation_prompt=True)
    expected = reference(hf_processor, prompt, videos=[gif])
    assert choice["prompt_token_ids"] == expected["input_ids"][0].tolist()
    assert choice["response_token_ids"] == oracle_tokens(tiny_m3_vl_checkpoint, expected)


@pytest.mark.parametrize(
    "url",
    [
        "data:image/png," + urllib.parse.quote_from_bytes(PNG),
        "data:image/png," + base64.b64encode(PNG).decode(),
        "data:application/octet-stream;base64," + base64.b64encode(PNG).decode(),
        "/octet",
    ],
    ids=["percent-encoded data URL", "base64 without the marker", "octet-stream data URL", "octet-stream over HTTP"],
)
def test_image_urls_transformers_reads_are_served(server, media_host, hf_processor, url):
    url = media_host + url if url.startswith("/") else url
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "?"}]}]
    response = chat(server, messages)
    assert response.status_code == 200, response.text
    prompt = hf_processor.tokenizer.apply_chat_template(template_messages(messages), tokenize=False, add_generation_prompt=True)
    assert response.json()["choices"][0]["prompt_token_ids"] == reference(hf_processor, prompt, [PNG])["input_ids"][0].tolist()


def test_request_mm_processor_kwargs_are_honoured(server, hf_processor, tiny_m3_vl_checkpoint):
    image = encode_image(random_image(300, 200, seed=54), "PNG")
    messages = [{"role": "user", "content": [image_part(image), {"type": "video_url", "video_url": {"url": data_url("video/quicktime", THREE_FRAMES)}}]}]
    kwargs = {"max_pixels": 28 * 28 * 12, "videos_kwargs": {"min_pixels": 28 * 28 * 8}}
    response = chat(server, messages, mm_processor_kwargs=kwargs)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    prompt = hf_processor.tokenizer.apply_chat_template(template_messages(messages), tokenize=False, add_generation_prompt=True)
    expected = reference(hf_processor, prompt, [image], [THREE_FRAMES], max_pixels=28 * 28 * 12, videos_kwargs={"min_pixels": 28 * 28 * 8})
    assert choice["prompt_token_ids"] == expected["input_ids"][0].tolist()
    assert choice["response_token_ids"] == oracle_tokens(tiny_m3_vl_checkpoint, expected)
    refused = chat(server, messages, mm_processor_kwargs={"max_slice_nums": 9})
    assert refused.status_code == 400, refused.text
    assert "mm_processor_kwargs: max_slice_nums is not a media option" in refused.text


def _closed_port_url() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}/a.png"


@pytest.mark.parametrize(
    "url,reason",
    [
        ("closed port", r"image 2: fetching http://127\.0\.0\.1:\d+/a\.png failed: ConnectionError"),
        ("/missing", r"image 2: fetching http://127\.0\.0\.1:\d+/missing failed: HTTP 404"),
        ("/drip", rf"image 2: fetching http://127\.0\.0\.1:\d+/drip took longer than {URL_TIMEOUT_S} s"),
        ("http://host.invalid/a.png", r"image 2: fetching http://host\.invalid/a\.png failed: ConnectionError"),
        ("data:image/png,%89PNG%zz", r"image 2: invalid percent-encoding in the data URL"),
        ("data:image/png;base64,AAAA", r"image 2: content is not a supported image"),
        ("https://", r"image 2: fetching https:// failed: InvalidURL"),
    ],
)
def test_unreadable_image_urls_get_a_400_naming_the_image_in_time(server, media_host, url, reason):
    url = _closed_port_url() if url == "closed port" else media_host + url if url.startswith("/") else url
    messages = [{"role": "user", "content": [image_part(PNG), {"type": "image_url", "image_url": {"url": url}}]}]
    started = time.monotonic()
    response = chat(server, messages)
    assert response.status_code == 400, response.text
    assert re.search(reason, response.text), response.text
    assert time.monotonic() - started < URL_TIMEOUT_S + 60  # unfixed, it held the request for 600 s
    follow_up = generate(server, "]<]image[>[", [data_url("image/png", PNG)])
    assert follow_up.status_code == 200, follow_up.text
