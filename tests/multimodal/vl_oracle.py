"""The VL oracle shared by the CPU and GPU vision-server tests: transformers' processor and M3 VL
model on the same media, and the served side's request and answer.

The oracle computes vision features one media item per call: transformers' tower attends across
every item of one call, while the served tower (like SGLang's upstream M3) keeps each image to
itself, so per-item calls are the reference that does not depend on batching.
"""

from __future__ import annotations

import base64
import io

import requests
import torch
from PIL import Image
from transformers import AutoProcessor
from transformers.video_utils import VideoMetadata
from transformers_oracle import load_reference_model

from tests.multimodal.media_factory import decode_all_frames, encode_image, random_image

NEW_TOKENS = 8
IMAGE_A = encode_image(random_image(120, 90, seed=5), "PNG")
IMAGE_B = encode_image(random_image(61, 150, "RGBA", seed=6), "PNG")
IMAGE_C = encode_image(random_image(120, 90, seed=7), "PNG")  # same size as A, other pixels


def data_url(mime: str, payload: bytes) -> str:
    return f"data:{mime};base64,{base64.b64encode(payload).decode()}"


def processed(model_dir: str, prompt: str, images=(), video: bytes | None = None):
    processor = AutoProcessor.from_pretrained(model_dir)
    kwargs = {}
    if images:
        kwargs["images"] = [Image.open(io.BytesIO(data)) for data in images]
    if video is not None:
        frames, native = decode_all_frames(video)
        metadata = VideoMetadata(total_num_frames=len(frames), fps=native, height=frames.shape[1], width=frames.shape[2])
        kwargs["videos"] = [frames]
        kwargs["videos_kwargs"] = {"do_resize": True, "do_sample_frames": True, "fps": 1.0, "video_metadata": [metadata]}
    return processor(text=[prompt], return_tensors="pt", add_special_tokens=False, **kwargs)


@torch.no_grad()
def oracle_tokens(model_dir: str, inputs, new_tokens: int = NEW_TOKENS) -> list[int]:
    model = load_reference_model(model_dir)
    vl = model.model
    ids = inputs["input_ids"]
    embeds = vl.get_input_embeddings()(ids)
    for key, grid_key, token_id in [
        ("pixel_values", "image_grid_thw", model.config.image_token_id),
        ("pixel_values_videos", "video_grid_thw", model.config.video_token_id),
    ]:
        if key not in inputs:
            continue
        rows, start = [], 0
        for grid in inputs[grid_key]:
            count = int(grid.prod())
            rows.append(vl.get_image_features(inputs[key][start : start + count], grid[None]).pooler_output[0])
            start += count
        mask = (ids == token_id)[..., None].expand_as(embeds)
        embeds = embeds.masked_scatter(mask, torch.cat(rows).to(embeds.dtype))
    out = []
    for _ in range(new_tokens):
        hidden = vl.language_model(inputs_embeds=embeds).last_hidden_state
        token = int(model.lm_head(hidden[:, -1]).argmax(-1))
        out.append(token)
        embeds = torch.cat([embeds, vl.get_input_embeddings()(torch.tensor([[token]]))], dim=1)
    return out


def generate(server, prompt: str, images=(), video: bytes | None = None):
    body = {
        "text": prompt,
        "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True},
        "return_logprob": True,
    }
    if images:
        body["image_data"] = [data_url("image/png", data) for data in images]
    if video is not None:
        body["video_data"] = [data_url("video/mp4", video)]
    response = requests.post(f"{server.base_url}/generate", json=body, timeout=600)
    assert response.status_code == 200, response.text
    return response.json()


def served_tokens(result) -> list[int]:
    return [t[1] for t in result["meta_info"]["output_token_logprobs"]]


#: prompt, images, video (the videos are the CPU test's: the GPU harness has no PyAV to encode them)
IMAGE_CASES = {
    "one image": ("Describe ]<]image[>[ briefly.", [IMAGE_A], None),
    "two images": ("First ]<]image[>[ then ]<]image[>[ compare them.", [IMAGE_A, IMAGE_B], None),
}
