"""The real SGLang server (CPU platform) against transformers' M3 on the same tiny checkpoints.

Four checkpoints, one server each (the text-only shipped one is the session's shared server):
text-only and VL, with config.json in the shipped layout and in the layout transformers writes
(``sglang_m3.tiny.checkpoint``). The shipped VL one also carries an MTP module the server must
skip, and every VL one has a vision tower whose sizes differ from the text model's. Each server
runs with a prefill chunk of 100 tokens (not a multiple of the block size 16, so chunks start
mid-block) and the radix cache on, and serves the same checks: prompts of one and of several
chunks, a radix-cache hit, and 8 concurrent requests. Every check compares greedy tokens
(identical) and prompt logprobs (within 2e-3, float32) with transformers. Long prompts prefilled
in one pass are checked in test_transformers_saved_checkpoint.py.

The tiny model has block size 16, top-4 blocks and 3 sparse layers, so prompts of several
hundred tokens (20+ blocks) make the sparse selection drop most of the context: these are MSA
outputs, not dense attention in disguise.
"""

from __future__ import annotations

import concurrent.futures
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
from server_harness import TINY_PREFILL_CHUNK, launch_cpu_server
from transformers_oracle import random_prompt

from tests.e2e.served_vs_reference import assert_matches_reference, generate, output_ids

pytestmark = pytest.mark.server

PROMPTS = {"p61": random_prompt(4, 61), "p233": random_prompt(3, 233), "p310": random_prompt(1, 310), "p457": random_prompt(2, 457)}
CHUNK = TINY_PREFILL_CHUNK
CONCURRENT_LENGTHS = (37, 97, 130, 166, 250, 301, 350, 412)


@dataclass
class Served:
    server: object
    model_dir: str
    label: str


CASES = [
    pytest.param(("shipped", False, 0), id="text-shipped"),
    pytest.param(("hf", False, 0), id="text-hf"),
    pytest.param(("shipped", True, 1), id="vl-shipped-mtp"),
    pytest.param(("hf", True, 0), id="vl-hf"),
]


@pytest.fixture(scope="module", params=CASES)
def served(request, tiny_checkpoint_factory, server_log_dir):
    """A server with prefill chunks of CHUNK tokens and the radix cache, per checkpoint, in turn.

    The text-only shipped checkpoint is the session's shared server (started with the same
    chunk size), so it costs no extra start.
    """
    layout, vision, mtp = request.param
    label = f"{'vl' if vision else 'text'}-{layout}{'-mtp' if mtp else ''}"
    model_dir = tiny_checkpoint_factory(vision=vision, layout=layout, mtp_modules=mtp)
    if (layout, vision, mtp) == ("shipped", False, 0):
        yield Served(request.getfixturevalue("tiny_m3_server"), model_dir, label)
        return
    with launch_cpu_server(model_dir, server_log_dir, "--chunked-prefill-size", str(CHUNK)) as server:
        yield Served(server, model_dir, label)


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_chunked_prefill_matches_transformers(served, name):
    assert_matches_reference(served.server, served.model_dir, PROMPTS[name], f"{served.label} {name}")


def test_radix_cache_hit_matches_transformers(served):
    shared = random_prompt(11, 203)  # 203 = 12 blocks + 11 tokens: the cached prefix ends mid-block
    first = shared + random_prompt(12, 40)
    second = shared + random_prompt(13, 157)  # the extension spans two chunks
    generate(served.server, first)
    # Logprobs from the end of the shared prefix on: the server may then reuse the whole prefix.
    result = generate(served.server, second, logprob_start=len(shared))
    assert result["meta_info"]["cached_tokens"] >= len(shared)
    assert_matches_reference(served.server, served.model_dir, second, f"{served.label} radix", result=result)
    again = generate(served.server, second)
    # Everything but the last prompt token, whose logits must be computed again.
    assert again["meta_info"]["cached_tokens"] == len(second) - 1
    assert output_ids(again) == output_ids(result)


def test_eight_concurrent_requests_match_transformers(served):
    prompts = [random_prompt(20 + i, n) for i, n in enumerate(CONCURRENT_LENGTHS)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        results = list(pool.map(lambda p: generate(served.server, p, logprob_start=0), prompts))
    for prompt, result in zip(prompts, results):
        assert_matches_reference(served.server, served.model_dir, prompt, f"{served.label} concurrent len {len(prompt)}", result=result)


def test_mtp_module_was_skipped_at_load(served):
    if "mtp" not in served.label:
        pytest.skip("checkpoint without MTP modules")
    with open(served.server.log_path, encoding="utf-8", errors="replace") as handle:
        log = handle.read()
    assert "skipped 8 multi-token-prediction tensor(s)" in log


def test_vl_server_image_request_matches_transformers(served):
    """An image through the VL server (vision tower sized unlike the text model)."""
    if not served.label.startswith("vl"):
        pytest.skip("text-only checkpoint")
    from tests.multimodal.media_factory import encode_image, random_image
    from tests.multimodal.test_e2e_vision_server import generate as generate_media
    from tests.multimodal.test_e2e_vision_server import oracle_tokens, processed, served_tokens

    prompt, image = "Describe ]<]image[>[ briefly.", encode_image(random_image(120, 90, seed=5), "PNG")
    inputs = processed(served.model_dir, prompt, [image])
    result = generate_media(served.server, prompt, [image])
    assert result["meta_info"]["prompt_tokens"] == inputs["input_ids"].shape[1]
    assert served_tokens(result) == oracle_tokens(served.model_dir, inputs)


def test_out_of_vocabulary_ids_are_refused_and_server_keeps_serving(tiny_m3_server):
    """An id past the vocabulary (or negative) is a 400 naming it, on /generate and through the
    openai client's token-id prompt; before the plugin's check it crashed the server."""
    import openai

    config = json.loads((Path(tiny_m3_server.model_path) / "config.json").read_text())
    vocab = config.get("text_config", config)["vocab_size"]
    prompt = random_prompt(32, 40)
    for position, token in ((7, vocab), (0, -1)):
        bad = prompt[:position] + [token] + prompt[position + 1:]
        response = requests.post(
            f"{tiny_m3_server.base_url}/generate",
            json={"input_ids": bad, "sampling_params": {"max_new_tokens": 2}},
            timeout=900,
        )
        assert response.status_code == 400, response.text
        assert f"input_ids[{position}] = {token}" in response.text and str(vocab - 1) in response.text
    client = openai.OpenAI(base_url=tiny_m3_server.openai_url, api_key="unused")
    with pytest.raises(openai.BadRequestError, match=f"input_ids\\[3\\] = {vocab + 5}"):
        client.completions.create(model=client.models.list().data[0].id, prompt=prompt[:3] + [vocab + 5], max_tokens=2)
    follow_up = generate(tiny_m3_server, prompt, max_new_tokens=3)
    assert len(output_ids(follow_up)) == 3


def test_over_long_request_is_refused_and_server_keeps_serving(tiny_m3_server):
    too_long = random_prompt(30, 5000)  # context length is 4096
    response = requests.post(
        f"{tiny_m3_server.base_url}/generate",
        json={"input_ids": too_long, "sampling_params": {"max_new_tokens": 4}},
        timeout=900,
    )
    assert response.status_code == 400 or "error" in response.text.lower()
    assert "context" in response.text.lower() or "longer" in response.text.lower()
    follow_up = generate(tiny_m3_server, random_prompt(31, 50), max_new_tokens=3)
    assert len(output_ids(follow_up)) == 3
