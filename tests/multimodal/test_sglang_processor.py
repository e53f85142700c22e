"""The SGLang processor class on the tiny VL checkpoint: same ids and pixels as transformers' processor."""

import asyncio
import base64
import io
import os
from types import SimpleNamespace

import pytest
import torch
from PIL import Image
from transformers import AutoProcessor
from transformers.video_utils import VideoMetadata

from sglang_m3.multimodal.errors import MediaError
from sglang_m3.multimodal.sglang_processor import (
    PACKAGE,
    PACKAGE_ENV,
    MiniMaxM3MultimodalProcessor,
    register_multimodal_processor,
)
from tests.multimodal.media_factory import decode_all_frames, encode_image, encode_video, random_frames, random_image

IMAGE_A = encode_image(random_image(90, 61, seed=1), "PNG")
IMAGE_B = encode_image(random_image(40, 130, "RGBA", seed=2), "PNG")
VIDEO = encode_video(random_frames(12, 64, 40), 4)


@pytest.fixture(scope="module")
def tiny_vl(tiny_m3_vl_checkpoint):
    return tiny_m3_vl_checkpoint


@pytest.fixture(scope="module")
def server_args(tiny_vl):
    from sglang.srt.server_args import ServerArgs

    return ServerArgs(model_path=tiny_vl, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def context(server_args):
    from sglang.srt.runtime_context import create_context, use_context

    with use_context(create_context(server_args, role="tokenizer")) as ctx:
        yield ctx


@pytest.fixture(scope="module")
def hf_processor(tiny_vl):
    return AutoProcessor.from_pretrained(tiny_vl)


@pytest.fixture(scope="module")
def processor(context, server_args, tiny_vl, hf_processor):
    from transformers import AutoConfig

    ours = MiniMaxM3MultimodalProcessor(AutoConfig.from_pretrained(tiny_vl), server_args, hf_processor, None)
    yield ours
    ours.shutdown()


def process(processor, prompt, images=(), videos=()):
    request = SimpleNamespace(video_data=list(videos) or None)
    return asyncio.run(processor.process_mm_data_async(list(images) or None, None, prompt, request))


def hf_reference(hf_processor, prompt, images=(), videos=()):
    kwargs = {}
    if videos:
        frames, native = decode_all_frames(VIDEO)
        metadata = VideoMetadata(total_num_frames=len(frames), fps=native, height=frames.shape[1], width=frames.shape[2])
        kwargs = dict(
            videos=[frames],
            videos_kwargs={"do_resize": True, "do_sample_frames": True, "fps": 1.0, "video_metadata": [metadata]},
        )
    if images:
        kwargs["images"] = [Image.open(io.BytesIO(data)) for data in images]
    return hf_processor(text=[prompt], return_tensors="pt", add_special_tokens=False, **kwargs)


def test_two_images_and_a_video_match_transformers_processor(processor, hf_processor):
    prompt = "]~b]user\nCompare ]<]image[>[ with ]<]image[>[ and the clip ]<]video[>[ please[e~[\n]~b]ai\n"
    output = process(processor, prompt, [IMAGE_A, IMAGE_B], [VIDEO])
    expected = hf_reference(hf_processor, prompt, [IMAGE_A, IMAGE_B], [VIDEO])
    assert output.input_ids == expected["input_ids"][0].tolist()
    images = [item for item in output.mm_items if item.modality.name == "IMAGE"]
    video = [item for item in output.mm_items if item.modality.name == "VIDEO"]
    torch.testing.assert_close(torch.cat([i.feature for i in images]), expected["pixel_values"], rtol=0, atol=1e-6)
    assert torch.cat([i.image_grid_thw for i in images]).tolist() == expected["image_grid_thw"].tolist()
    torch.testing.assert_close(video[0].feature, expected["pixel_values_videos"], rtol=0, atol=1e-6)
    assert video[0].video_grid_thw.tolist() == expected["video_grid_thw"].tolist()
    # each item's spans cover exactly its placeholder tokens
    ids = output.input_ids
    for item, token in [(images[0], output.im_token_id), (images[1], output.im_token_id), (video[0], output.video_token_id)]:
        assert all(set(ids[s : e + 1]) == {token} for s, e in item.offsets)
    assert sum(e - s + 1 for s, e in images[0].offsets) == int(images[0].image_grid_thw.prod()) // 4
    assert len(video[0].offsets) == int(video[0].video_grid_thw[0, 0])


def test_token_id_prompt_expands_like_text(processor, hf_processor):
    prompt = "look ]<]image[>[ now"
    ids = hf_processor.tokenizer.encode(prompt, add_special_tokens=False)
    from_ids = process(processor, ids, [IMAGE_A])
    from_text = process(processor, prompt, [IMAGE_A])
    assert from_ids.input_ids == from_text.input_ids


def test_media_errors_reach_the_caller_naming_the_part(processor):
    with pytest.raises(MediaError, match=r"^image 2: .*corrupt or truncated"):
        process(processor, "]<]image[>[]<]image[>[", [IMAGE_A, IMAGE_B[:200]])
    with pytest.raises(MediaError, match=r"^request: the prompt has 1 image placeholder\(s\) but the request carries 2"):
        process(processor, "]<]image[>[", [IMAGE_A, IMAGE_B])
    with pytest.raises(MediaError, match=r"^audio 1: "):
        asyncio.run(processor.process_mm_data_async(None, [b"x"], "hi", SimpleNamespace(video_data=None)))


def test_per_video_fps_is_honoured(processor):
    data_url = "data:video/mp4;base64," + base64.b64encode(VIDEO).decode()
    one = process(processor, "]<]video[>[", videos=[{"url": data_url, "fps": 1.0}])
    four = process(processor, "]<]video[>[", videos=[{"url": data_url, "preprocess_kwargs": {"fps": 4.0}}])
    assert one.mm_items[0].video_grid_thw[0, 0] == 2 and four.mm_items[0].video_grid_thw[0, 0] == 6


def test_per_item_pixel_bounds_and_frame_cap_are_honoured(processor, hf_processor):
    """Chat-shaped items (SGLang's ``ImageData`` / ``VideoData``): the ids and features equal
    transformers' processor given the same bounds; the frame cap picks its uniform frames."""
    from sglang.srt.utils import ImageData, VideoData
    from transformers.video_utils import default_sample_indices_fn

    image = ImageData(
        url="data:image/png;base64," + base64.b64encode(IMAGE_A).decode(),
        preprocess_kwargs={"min_pixels": 28 * 28, "max_pixels": 28 * 28 * 2},
    )
    video = VideoData(
        url="data:video/mp4;base64," + base64.b64encode(VIDEO).decode(),
        preprocess_kwargs={"fps": 4.0, "max_frames": 3, "min_pixels": 28 * 28 * 12},
    )
    prompt = "Compare ]<]image[>[ and ]<]video[>[ please"
    output = process(processor, prompt, [image], [video])
    frames, native = decode_all_frames(VIDEO)
    metadata = VideoMetadata(total_num_frames=len(frames), fps=native, height=frames.shape[1], width=frames.shape[2])
    indices = default_sample_indices_fn(metadata, num_frames=3)
    metadata.frames_indices = indices
    expected = hf_processor(
        text=[prompt],
        images=[Image.open(io.BytesIO(IMAGE_A))],
        videos=[frames[indices]],
        images_kwargs={"size": {"shortest_edge": 28 * 28, "longest_edge": 28 * 28 * 2}},
        videos_kwargs={"do_resize": True, "do_sample_frames": False, "min_pixels": 28 * 28 * 12, "video_metadata": [metadata]},
        return_tensors="pt",
        add_special_tokens=False,
    )
    assert output.input_ids == expected["input_ids"][0].tolist()
    image_item, video_item = output.mm_items
    assert image_item.image_grid_thw.tolist() == expected["image_grid_thw"].tolist() == [[1, 2, 2]]
    assert video_item.video_grid_thw.tolist() == expected["video_grid_thw"].tolist()
    torch.testing.assert_close(image_item.feature, expected["pixel_values"], rtol=0, atol=1e-6)
    torch.testing.assert_close(video_item.feature, expected["pixel_values_videos"], rtol=0, atol=1e-6)


def test_features_travel_in_the_model_dtype(tiny_vl, hf_processor):
    from sglang.srt.runtime_context import create_context, use_context
    from sglang.srt.server_args import ServerArgs
    from transformers import AutoConfig

    bf16_args = ServerArgs(model_path=tiny_vl, device="cpu", dtype="bfloat16")
    with use_context(create_context(bf16_args, role="tokenizer")):
        bf16 = MiniMaxM3MultimodalProcessor(AutoConfig.from_pretrained(tiny_vl), bf16_args, hf_processor, None)
        output = process(bf16, "]<]image[>[", [IMAGE_A])
        bf16.shutdown()
    expected = hf_reference(hf_processor, "]<]image[>[", [IMAGE_A])["pixel_values"].to(torch.bfloat16)
    assert output.mm_items[0].feature.dtype == torch.bfloat16
    assert torch.equal(output.mm_items[0].feature, expected)


def test_registration_replaces_the_upstream_processor(context, tiny_vl, monkeypatch):
    from sglang.srt.managers import multimodal_processor as registry
    from transformers import AutoConfig

    monkeypatch.delenv(PACKAGE_ENV, raising=False)
    monkeypatch.setattr(registry, "PROCESSOR_MAPPING", {})
    registry.import_processors("sglang.srt.multimodal.processors")  # what the tokenizer manager does
    hf_config = AutoConfig.from_pretrained(tiny_vl)
    assert registry.get_mm_processor_cls(hf_config).__module__.startswith("sglang.srt.")
    register_multimodal_processor()
    assert os.environ[PACKAGE_ENV] == PACKAGE
    registry.import_processors(os.environ[PACKAGE_ENV], overwrite=True)
    assert registry.get_mm_processor_cls(hf_config) is MiniMaxM3MultimodalProcessor


def test_registration_leaves_a_foreign_package_alone(monkeypatch):
    monkeypatch.setenv(PACKAGE_ENV, "someone.elses.processors")
    register_multimodal_processor()
    assert os.environ[PACKAGE_ENV] == "someone.elses.processors"
