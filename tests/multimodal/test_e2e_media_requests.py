"""What users send through the server's APIs: media in several turns, and media or options the
server refuses (HTTP 400 naming the part, the server serving on)."""

from __future__ import annotations

import base64
import io

import pytest
import requests
from PIL import Image
from server_harness import launch_cpu_server
from transformers import AutoProcessor
from transformers.video_utils import VideoMetadata

from sglang_m3.multimodal.sglang_processor import PACKAGE_ENV
from tests.multimodal.media_factory import decode_all_frames, encode_image, encode_video, random_frames, random_image


def _project_serves_vl() -> bool:
    from sglang.srt.models.registry import import_model_classes

    return "MiniMaxM3SparseForConditionalGeneration" in import_model_classes("sglang_m3.models", strict=True)


pytestmark = [
    pytest.mark.server,
    pytest.mark.skipif(not _project_serves_vl(), reason="sglang_m3.models has no VL model class yet"),
]

IMAGES = [encode_image(random_image(70 + 9 * i, 50 + 13 * i, mode, seed=30 + i), "PNG") for i, mode in enumerate(("RGB", "RGBA", "L"))]
VIDEO = encode_video(random_frames(9, 60, 44, seed=33), 3)


def data_url(mime: str, payload: bytes) -> str:
    return f"data:{mime};base64,{base64.b64encode(payload).decode()}"


def image_part(data: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url("image/png", data)}}


@pytest.fixture(scope="module")
def server(tiny_m3_vl_checkpoint, server_log_dir):
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv(PACKAGE_ENV, raising=False)
        with launch_cpu_server(tiny_m3_vl_checkpoint, server_log_dir) as running:
            yield running


def chat(server, messages, **extra):
    body = {"model": "default", "messages": messages, "max_tokens": 2, "temperature": 0, **extra}
    return requests.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=600)


def expected_prompt_tokens(model_dir: str, messages: list[dict], images: list[bytes], video: bytes) -> int:
    """transformers' processor on the prompt the checkpoint's chat template renders."""
    processor = AutoProcessor.from_pretrained(model_dir)
    prompt = processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    frames, native = decode_all_frames(video)
    metadata = VideoMetadata(total_num_frames=len(frames), fps=native, height=frames.shape[1], width=frames.shape[2])
    inputs = processor(
        text=[prompt],
        images=[Image.open(io.BytesIO(data)) for data in images],
        videos=[frames],
        videos_kwargs={"do_resize": True, "do_sample_frames": True, "fps": 1.0, "video_metadata": [metadata]},
        add_special_tokens=False,
    )
    return len(inputs["input_ids"][0])


def test_media_in_system_user_and_assistant_turns(server, tiny_m3_vl_checkpoint):
    video_part = {"type": "video_url", "video_url": {"url": data_url("video/mp4", VIDEO)}}
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "Reference:"}, image_part(IMAGES[0])]},
        {"role": "user", "content": [image_part(IMAGES[1]), video_part, {"type": "text", "text": "Same scene?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Like this:"}, image_part(IMAGES[2])]},
        {"role": "user", "content": "And now?"},
    ]
    response = chat(server, messages)
    assert response.status_code == 200, response.text
    template_messages = [
        {**m, "content": m["content"] if isinstance(m["content"], str) else [
            {"type": p["type"].removesuffix("_url")} if p["type"] != "text" else p for p in m["content"]
        ]}
        for m in messages
    ]
    assert response.json()["usage"]["prompt_tokens"] == expected_prompt_tokens(
        tiny_m3_vl_checkpoint, template_messages, IMAGES, VIDEO
    )


@pytest.mark.parametrize("fps", [0, 50.0])
def test_native_video_rate_outside_the_limits_gets_a_400_naming_the_video(server, fps):
    """SGLang's schema gate admits any number as a video's fps; the range is ours to refuse."""
    body = {
        "text": "]<]video[>[ and ]<]video[>[",
        "video_data": [data_url("video/mp4", VIDEO), {"url": data_url("video/mp4", VIDEO), "fps": fps}],
        "sampling_params": {"max_new_tokens": 2},
    }
    response = requests.post(f"{server.base_url}/generate", json=body, timeout=600)
    assert response.status_code == 400, response.text
    assert f"video 2: fps {float(fps)} is outside [0.1, 10.0]" in response.text
    served = requests.post(
        f"{server.base_url}/generate",
        json={"text": "]<]image[>[ ok", "image_data": [data_url("image/png", IMAGES[0])], "sampling_params": {"max_new_tokens": 2}},
        timeout=600,
    )
    assert served.status_code == 200, served.text


def test_chat_image_url_of_another_scheme_gets_a_400_naming_the_image(server):
    messages = [{"role": "user", "content": [image_part(IMAGES[0]), {"type": "image_url", "image_url": {"url": "ftp://host/a.png"}}]}]
    response = chat(server, messages)
    assert response.status_code == 400, response.text
    assert "image 2: unsupported URL scheme 'ftp'" in response.text
