"""Sparse offload served for real on the CPU platform: the same answers as the all-device server.

One server runs the tiny M3 (MSA blocks of 16 tokens, top-4, 2 KV heads: one decode token selects at
most 8 blocks per layer) with ``SGLANG_M3_SPARSE_OFFLOAD_BLOCKS=16`` (16 cache entries per sparse
layer, two requests per round) and ``--page-size 16``; prefill is chunked. Its greedy tokens and
logprobs are compared with the session's server that keeps every K/V on the device, for a prompt of
63 blocks, for concurrent requests and for a radix hit, and the prompt logprobs with transformers.
Its host budget (``SGLANG_M3_SPARSE_OFFLOAD_HOST_GB``, 1,536 host bytes per token: 3 sparse layers x
2 heads x (32 + 32) fp32) holds fewer tokens than ``--max-total-tokens``: the slot pool shrinks to
it, and requests that do not fit together wait instead of failing.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from offload_helpers import counters as log_counters
from offload_helpers import output_logprobs
from server_harness import expect_start_refused, launch_cpu_server
from transformers_oracle import random_prompt

from sglang_m3.cache.offload_budget import SPARSE_OFFLOAD_HOST_GB_ENV
from sglang_m3.cache.offload_settings import SPARSE_OFFLOAD_BLOCKS_ENV, SPARSE_OFFLOAD_LOG_STEPS_ENV
from tests.e2e.served_vs_reference import assert_matches_reference, generate, output_ids

pytestmark = pytest.mark.server

CACHE_BLOCKS = 16
BLOCK = 16
LONG_PROMPT = random_prompt(41, 1000)  # 63 blocks, four times what a layer's cache holds
#: output logprobs of the two servers differ by summation order only (other chunking and batching)
LOGPROB_NOISE = 1e-4
OFFLOAD_FLAGS = ("--page-size", str(BLOCK), "--chunked-prefill-size", "112")
#: 1e7 bytes / 1,536 per token = 406 pages of 16, less the padding page: 6,480 of the 8,192 slots asked for
HOST_GB, HOST_TOKENS = "0.01", 6480
OFFLOAD_ENV = {SPARSE_OFFLOAD_BLOCKS_ENV: str(CACHE_BLOCKS), SPARSE_OFFLOAD_LOG_STEPS_ENV: "1", SPARSE_OFFLOAD_HOST_GB_ENV: HOST_GB}


@pytest.fixture(scope="module")
def offload_server(tiny_m3_checkpoint, server_log_dir):
    with launch_cpu_server(tiny_m3_checkpoint, server_log_dir, *OFFLOAD_FLAGS, env=OFFLOAD_ENV) as server:
        yield server


def assert_same_answer(offloaded, on_device, label):
    assert output_ids(offloaded) == output_ids(on_device), f"greedy tokens of {label} differ with offload"
    diff = max(abs(a - b) for a, b in zip(output_logprobs(offloaded), output_logprobs(on_device)))
    assert diff < LOGPROB_NOISE, f"output logprobs of {label} differ by {diff}"


def counters(server) -> dict[str, int]:
    """The last block-cache totals the server logged (zeros before its first decode step)."""
    return log_counters(open(server.log_path, encoding="utf-8").read())


def test_long_prompt_through_a_small_block_cache_answers_as_on_the_device(offload_server, tiny_m3_server, tiny_m3_checkpoint):
    before = counters(offload_server)
    offloaded = generate(offload_server, LONG_PROMPT, logprob_start=len(LONG_PROMPT) - 200)
    assert_same_answer(offloaded, generate(tiny_m3_server, LONG_PROMPT, logprob_start=len(LONG_PROMPT) - 200), "a 63-block prompt")
    assert_matches_reference(offload_server, tiny_m3_checkpoint, LONG_PROMPT, "a 63-block prompt under offload",
                             result=offloaded)
    after = counters(offload_server)
    assert after["steps"] > before["steps"], "the offload server logged no block-cache counters"
    assert after["misses"] - before["misses"] > 3 * CACHE_BLOCKS, "decode fetched no more blocks than one cache holds"
    assert after["hits"] > before["hits"] and after["h2d_bytes"] > before["h2d_bytes"]


def test_concurrent_requests_answer_as_on_the_device(offload_server, tiny_m3_server):
    prompts = [random_prompt(50 + i, 300 + 110 * i) for i in range(5)]  # 5 requests: 3 rounds per layer
    with ThreadPoolExecutor(len(prompts)) as pool:
        offloaded = list(pool.map(lambda p: generate(offload_server, p, logprob_start=len(p) - 1), prompts))
    for i, (prompt, result) in enumerate(zip(prompts, offloaded)):
        assert_same_answer(result, generate(tiny_m3_server, prompt, logprob_start=len(prompt) - 1), f"concurrent request {i}")


def test_a_radix_hit_reads_the_shared_prefix_from_the_host_store(offload_server, tiny_m3_server):
    prefix = random_prompt(60, 700)
    generate(offload_server, prefix + random_prompt(61, 30))
    second = prefix + random_prompt(62, 40)
    result = generate(offload_server, second, logprob_start=len(second) - 1)
    assert result["meta_info"]["cached_tokens"] >= len(prefix) // BLOCK * BLOCK
    assert_same_answer(result, generate(tiny_m3_server, second, logprob_start=len(second) - 1), "a radix hit")


def test_the_host_budget_caps_the_pool_and_requests_beyond_it_wait(offload_server, tiny_m3_server):
    assert f"max_total_num_tokens={HOST_TOKENS}," in open(offload_server.log_path, encoding="utf-8").read()
    prompts = [random_prompt(70 + i, 2000) for i in range(4)]  # 8,000 tokens: not all fit at once
    with ThreadPoolExecutor(len(prompts)) as pool:
        offloaded = list(pool.map(lambda p: generate(offload_server, p, logprob_start=len(p) - 1), prompts))
    for i, (prompt, result) in enumerate(zip(prompts, offloaded)):
        assert_same_answer(result, generate(tiny_m3_server, prompt, logprob_start=len(prompt) - 1), f"over-budget request {i}")


def test_a_host_budget_below_one_full_length_request_is_refused_by_name(tiny_m3_checkpoint, server_log_dir, monkeypatch):
    monkeypatch.setenv(SPARSE_OFFLOAD_BLOCKS_ENV, str(CACHE_BLOCKS))
    monkeypatch.setenv(SPARSE_OFFLOAD_HOST_GB_ENV, "0.005")
    refused = expect_start_refused(tiny_m3_checkpoint, server_log_dir, "--page-size", str(BLOCK))
    assert refused.returncode != 0
    assert (f"{SPARSE_OFFLOAD_HOST_GB_ENV}=0.005: the host store holds 3,232 tokens (1,536 bytes each), fewer than "
            "one request of --context-length 4,096") in refused.log


def test_a_cache_smaller_than_one_requests_selection_is_refused_by_name(tiny_m3_checkpoint, server_log_dir, monkeypatch):
    monkeypatch.setenv(SPARSE_OFFLOAD_BLOCKS_ENV, "7")
    refused = expect_start_refused(tiny_m3_checkpoint, server_log_dir, "--page-size", str(BLOCK))
    assert refused.returncode != 0
    assert f"{SPARSE_OFFLOAD_BLOCKS_ENV}=7 is smaller than one request's selection" in refused.log
    assert f"set {SPARSE_OFFLOAD_BLOCKS_ENV} to at least 8" in refused.log
