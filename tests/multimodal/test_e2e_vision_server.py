"""The real CPU SGLang server with the tiny VL checkpoint against transformers' M3 VL model.

The oracle (``vl_oracle``) gets the same processed inputs (transformers' processor: token ids and
patch rows, shown equal to ours in test_sglang_processor) and decodes greedily.
"""

from __future__ import annotations

import io

import pytest
import requests
from PIL import Image
from server_harness import launch_cpu_server
from transformers import AutoProcessor

from sglang_m3.multimodal.sglang_processor import PACKAGE_ENV
from tests.multimodal.media_factory import encode_image, encode_video, random_frames, random_image
from tests.multimodal.vl_oracle import IMAGE_A, IMAGE_B, IMAGE_C, IMAGE_CASES, NEW_TOKENS, data_url, generate, oracle_tokens, processed, served_tokens


def _project_serves_vl() -> bool:
    """True once sglang_m3.models registers a class for the VL architecture."""
    from sglang.srt.models.registry import import_model_classes

    return "MiniMaxM3SparseForConditionalGeneration" in import_model_classes("sglang_m3.models", strict=True)


pytestmark = [
    pytest.mark.server,
    pytest.mark.skipif(not _project_serves_vl(), reason="sglang_m3.models has no VL model class yet"),
]


VIDEO = encode_video(random_frames(16, 84, 56, seed=8), 4)
CASES = {**IMAGE_CASES, "video": ("What happens in ]<]video[>[ here?", [], VIDEO)}


@pytest.fixture(scope="module")
def vl_server(tiny_m3_vl_checkpoint, server_log_dir):
    # The server must pick our processor through the plugin alone (register_multimodal_processor).
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv(PACKAGE_ENV, raising=False)
        with launch_cpu_server(tiny_m3_vl_checkpoint, server_log_dir) as server:
            yield server


@pytest.fixture(scope="module")
def vl_server_pp2(tiny_m3_vl_checkpoint, server_log_dir):
    """The same checkpoint at ``--pp-size 2``: the first stage builds the vision tower and embeds
    the media, the second never builds it and takes the first stage's hidden states."""
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv(PACKAGE_ENV, raising=False)
        with launch_cpu_server(tiny_m3_vl_checkpoint, server_log_dir, "--pp-size", "2") as server:
            yield server


def _assert_served_as_transformers(server, checkpoint, name):
    prompt, images, video = CASES[name]
    inputs = processed(checkpoint, prompt, images, video)
    result = generate(server, prompt, images, video)
    assert result["meta_info"]["prompt_tokens"] == inputs["input_ids"].shape[1]
    assert served_tokens(result) == oracle_tokens(checkpoint, inputs)


@pytest.mark.parametrize("name", sorted(CASES))
def test_greedy_tokens_match_transformers(vl_server, tiny_m3_vl_checkpoint, name):
    _assert_served_as_transformers(vl_server, tiny_m3_vl_checkpoint, name)


@pytest.mark.parametrize("name", ["two images", "video"])
def test_pipeline_stages_serve_media_as_transformers(vl_server_pp2, tiny_m3_vl_checkpoint, name):
    _assert_served_as_transformers(vl_server_pp2, tiny_m3_vl_checkpoint, name)


def test_radix_cache_reuses_a_repeated_image_prefix(vl_server, tiny_m3_vl_checkpoint):
    prefix = "Look at ]<]image[>[ carefully."
    prefix_len = processed(tiny_m3_vl_checkpoint, prefix, [IMAGE_A])["input_ids"].shape[1]
    generate(vl_server, prefix + " One.", [IMAGE_A])
    again = generate(vl_server, prefix + " Two more words.", [IMAGE_A])
    assert again["meta_info"]["cached_tokens"] >= prefix_len - 1
    inputs = processed(tiny_m3_vl_checkpoint, prefix + " Two more words.", [IMAGE_A])
    assert served_tokens(again) == oracle_tokens(tiny_m3_vl_checkpoint, inputs)
    # an image of the same size but other pixels must not hit the cached image tokens
    other = generate(vl_server, prefix + " Two more words.", [IMAGE_C])
    image_start = len(processed(tiny_m3_vl_checkpoint, "Look at ")["input_ids"][0])
    assert other["meta_info"]["cached_tokens"] <= image_start + 1


def test_bad_media_gets_a_400_naming_the_part_and_the_server_keeps_serving(vl_server):
    body = {
        "model": "default",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": data_url("image/png", IMAGE_A)}},
                    {"type": "image_url", "image_url": {"url": data_url("image/png", IMAGE_B[:300])}},
                    {"type": "text", "text": "compare"},
                ],
            }
        ],
        "max_tokens": 4,
    }
    response = requests.post(f"{vl_server.base_url}/v1/chat/completions", json=body, timeout=600)
    assert response.status_code == 400, response.text
    assert "image 2" in response.text and "truncated" in response.text
    follow_up = generate(vl_server, "Describe ]<]image[>[ briefly.", [IMAGE_A])
    assert len(served_tokens(follow_up)) == NEW_TOKENS


def test_openai_chat_with_an_image_and_a_video(vl_server, tiny_m3_vl_checkpoint):
    """The chat path: content parts -> template placeholders -> our processor -> the model."""
    body = {
        "model": "default",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is in"},
                    {"type": "image_url", "image_url": {"url": data_url("image/png", IMAGE_A)}},
                    {"type": "text", "text": "and in"},
                    {"type": "video_url", "video_url": {"url": data_url("video/mp4", VIDEO)}},
                ],
            }
        ],
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
    }
    response = requests.post(f"{vl_server.base_url}/v1/chat/completions", json=body, timeout=600)
    assert response.status_code == 200, response.text
    media = processed(tiny_m3_vl_checkpoint, "]<]image[>[]<]video[>[", [IMAGE_A], VIDEO)["input_ids"].shape[1]
    assert response.json()["usage"]["prompt_tokens"] > media
    assert response.json()["usage"]["completion_tokens"] == 4


def test_limits_come_from_mm_process_config(tiny_m3_vl_checkpoint, server_log_dir):
    large = encode_image(random_image(640, 480, seed=9), "PNG")
    config = '{"limits": {"max_images": 1}, "image": {"max_pixels": 12544}}'
    with launch_cpu_server(tiny_m3_vl_checkpoint, server_log_dir, "--mm-process-config", config) as server:
        body = {
            "text": "]<]image[>[ and ]<]image[>[",
            "image_data": [data_url("image/png", IMAGE_A)] * 2,
            "sampling_params": {"max_new_tokens": 2},
        }
        refused = requests.post(f"{server.base_url}/generate", json=body, timeout=600)
        assert refused.status_code == 400 and "request: 2 images, over the limit of 1" in refused.text
        served = generate(server, "Describe ]<]image[>[ briefly.", [large])
    capped = AutoProcessor.from_pretrained(tiny_m3_vl_checkpoint)
    capped.image_processor = type(capped.image_processor)(size={"shortest_edge": 3136, "longest_edge": 12544})
    expected = capped(
        text=["Describe ]<]image[>[ briefly."], images=[Image.open(io.BytesIO(large))], add_special_tokens=False
    )
    uncapped = processed(tiny_m3_vl_checkpoint, "Describe ]<]image[>[ briefly.", [large])
    assert served["meta_info"]["prompt_tokens"] == len(expected["input_ids"][0]) < uncapped["input_ids"].shape[1]
