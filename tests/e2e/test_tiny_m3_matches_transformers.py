"""The real SGLang server (CPU platform) against transformers' M3 on the same tiny checkpoint.

The tiny model has block size 16, top-4 blocks and 3 sparse layers, so prompts of several
hundred tokens (20+ blocks) make the sparse selection drop most of the context: these are MSA
outputs, not dense attention in disguise.
"""

from __future__ import annotations

import concurrent.futures

import pytest
import requests
import torch
from server_harness import launch_cpu_server
from transformers_oracle import greedy_tokens, prompt_logprobs, random_prompt

pytestmark = pytest.mark.server

PROMPTS = {"p310": random_prompt(1, 310), "p457": random_prompt(2, 457), "p233": random_prompt(3, 233)}
NEW_TOKENS = 12
LOGPROB_TOLERANCE = 2e-3


def generate(server, prompt_ids, max_new_tokens=NEW_TOKENS, logprobs=False):
    body = {"input_ids": prompt_ids, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}}
    if logprobs:
        body.update(return_logprob=True, logprob_start_len=0)
    response = requests.post(f"{server.base_url}/generate", json=body, timeout=600)
    response.raise_for_status()
    return response.json()


def output_ids(result) -> list[int]:
    return result["output_ids"] if "output_ids" in result else [t[1] for t in result["meta_info"]["output_token_logprobs"]]


def assert_matches_reference(server, model_dir, name):
    prompt = PROMPTS[name]
    result = generate(server, prompt, logprobs=True)
    served = [t[1] for t in result["meta_info"]["output_token_logprobs"]]
    assert served == greedy_tokens(model_dir, prompt, NEW_TOKENS), f"greedy continuation of {name} differs"
    served_lp = torch.tensor([t[0] for t in result["meta_info"]["input_token_logprobs"][1:]])
    diff = (served_lp - prompt_logprobs(model_dir, prompt)).abs().max().item()
    assert diff < LOGPROB_TOLERANCE, f"prompt logprobs of {name} differ by {diff}"


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_flat_config_matches_transformers(tiny_m3_server, tiny_m3_checkpoint, name):
    assert_matches_reference(tiny_m3_server, tiny_m3_checkpoint, name)


@pytest.fixture(scope="module")
def nested_checkpoint(tiny_checkpoint_factory):
    return tiny_checkpoint_factory(sparse_form="nested")


@pytest.fixture(scope="module")
def nested_server(nested_checkpoint, server_log_dir):
    with launch_cpu_server(nested_checkpoint, server_log_dir) as server:
        yield server


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_nested_sparse_config_matches_transformers(nested_server, nested_checkpoint, name):
    assert_matches_reference(nested_server, nested_checkpoint, name)


@pytest.fixture(scope="module")
def chunked_server(tiny_m3_checkpoint, server_log_dir):
    # 100 is not a multiple of the block size (16): chunks start mid-block.
    with launch_cpu_server(tiny_m3_checkpoint, server_log_dir, "--chunked-prefill-size", "100", "--disable-radix-cache") as server:
        yield server


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_chunked_prefill_unaligned_to_blocks_matches(chunked_server, tiny_m3_checkpoint, name):
    assert_matches_reference(chunked_server, tiny_m3_checkpoint, name)


def test_radix_cache_prefix_reuse_matches(tiny_m3_server, tiny_m3_checkpoint):
    shared = random_prompt(11, 203)  # 203 = 12 blocks + 11 tokens: the cached prefix ends mid-block
    first = shared + random_prompt(12, 40)
    second = shared + random_prompt(13, 57)
    generate(tiny_m3_server, first)
    result = generate(tiny_m3_server, second)
    assert result["meta_info"]["cached_tokens"] >= len(shared)
    assert output_ids(result) == greedy_tokens(tiny_m3_checkpoint, second, NEW_TOKENS)
    again = generate(tiny_m3_server, second)
    # Everything but the last prompt token, whose logits must be computed again.
    assert again["meta_info"]["cached_tokens"] == len(second) - 1
    assert output_ids(again) == output_ids(result)


def test_concurrent_requests_of_different_lengths_match(tiny_m3_server, tiny_m3_checkpoint):
    prompts = [random_prompt(20 + i, n) for i, n in enumerate((97, 166, 301, 412))]
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda p: generate(tiny_m3_server, p), prompts))
    for prompt, result in zip(prompts, results):
        assert output_ids(result) == greedy_tokens(tiny_m3_checkpoint, prompt, NEW_TOKENS)


def test_over_long_request_is_refused_and_server_keeps_serving(tiny_m3_server):
    too_long = random_prompt(30, 5000)  # context length is 4096
    response = requests.post(
        f"{tiny_m3_server.base_url}/generate",
        json={"input_ids": too_long, "sampling_params": {"max_new_tokens": 4}},
        timeout=120,
    )
    assert response.status_code == 400 or "error" in response.text.lower()
    assert "context" in response.text.lower() or "longer" in response.text.lower()
    follow_up = generate(tiny_m3_server, random_prompt(31, 50), max_new_tokens=3)
    assert len(output_ids(follow_up)) == 3
