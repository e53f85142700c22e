"""The host tier with fp8 index keys and pages of 16 tokens, served for real on the CPU platform.

Two servers of the tiny M3 with ``SGLANG_M3_INDEX_KEY_DTYPE=fp8_e4m3`` (e4m3 keys + one fp32 scale
per token), ``--page-size 16`` (one MSA block per page), a 1,024-token device pool and prefill
chunks of 112 tokens (SGLang wants whole pages): one with ``--enable-hierarchical-cache``, one
without (the oracle: the same server with the host tier switched off). Both serve a 300-token
prefix, then the same extension of it. On the oracle the prefix is still in the device pool; on the
host-tier server other traffic has pushed it out and it comes back from host memory (18 whole
pages): keys, scales, K and V. Both then compute the extension from the same cached values, so
every token and logprob must be identical: a key or a scale lost or misplaced on the way to the
host and back changes the blocks MSA selects. The second check splits one hit between the tiers:
the head of a prefix still in the device pool, its tail back from the host.
"""

from __future__ import annotations

import pytest
from offload_helpers import output_logprobs
from server_harness import launch_cpu_server
from transformers_oracle import random_prompt

from sglang_m3.recipe.render import INDEX_KEY_DTYPE_ENV
from tests.e2e.served_vs_reference import generate, output_ids

pytestmark = pytest.mark.server

PAGE = 16
PREFIX = random_prompt(201, 300)  # 18 pages and 12 tokens
FLAGS = ("--page-size", str(PAGE), "--max-total-tokens", "1024", "--context-length", "1024",
         "--chunked-prefill-size", "112")
FP8_KEYS = {INDEX_KEY_DTYPE_ENV: "fp8_e4m3"}


@pytest.fixture(scope="module")
def host_tier_server(tiny_m3_checkpoint, server_log_dir):
    with launch_cpu_server(tiny_m3_checkpoint, server_log_dir, *FLAGS, "--enable-hierarchical-cache",
                           "--hicache-size", "1", env=FP8_KEYS) as server:
        yield server


@pytest.fixture(scope="module")
def device_only_server(tiny_m3_checkpoint, server_log_dir):
    with launch_cpu_server(tiny_m3_checkpoint, server_log_dir, *FLAGS, env=FP8_KEYS) as server:
        yield server


def input_logprobs(result) -> list[float]:
    return [entry[0] for entry in result["meta_info"]["input_token_logprobs"]]


def test_fp8_keys_and_scales_come_back_from_the_host_tier(host_tier_server, device_only_server):
    first = PREFIX + random_prompt(202, 20)
    second = PREFIX + random_prompt(203, 150)
    served = {}
    for label, server in (("host tier", host_tier_server), ("device only", device_only_server)):
        generate(server, first)
        if server is host_tier_server:
            for seed in range(3):  # 3 x 400 tokens through the 1,024-token pool evict the prefix
                generate(server, random_prompt(210 + seed, 400), max_new_tokens=1)
        served[label] = generate(server, second, logprob_start=len(PREFIX) // PAGE * PAGE)

    cached = len(PREFIX) // PAGE * PAGE
    assert served["host tier"]["meta_info"]["cached_tokens_details"] == {"device": 0, "host": cached}
    assert served["device only"]["meta_info"]["cached_tokens"] == cached
    assert output_ids(served["host tier"]) == output_ids(served["device only"])
    assert input_logprobs(served["host tier"]) == input_logprobs(served["device only"])
    assert output_logprobs(served["host tier"]) == output_logprobs(served["device only"])


def test_a_hit_split_between_device_and_host_answers_as_the_device_alone(host_tier_server, device_only_server):
    head = random_prompt(221, 150)  # 9 whole pages and 6 tokens
    with_tail = head + random_prompt(222, 200)
    served = {}
    for label, server in (("host tier", host_tier_server), ("device only", device_only_server)):
        generate(server, with_tail)
        generate(server, head + random_prompt(223, 60))  # splits the tree at the head, and uses it last
        if server is host_tier_server:  # 700 new tokens: the tail leaves the device pool, the head stays
            generate(server, random_prompt(224, 700), max_new_tokens=1)
        served[label] = generate(server, with_tail + random_prompt(225, 40), logprob_start=len(with_tail) // PAGE * PAGE)

    split = served["host tier"]["meta_info"]["cached_tokens_details"]
    assert split["device"] > 0 and split["host"] > 0, f"the hit was not split between the tiers: {split}"
    assert split["device"] + split["host"] == served["device only"]["meta_info"]["cached_tokens"]
    assert output_ids(served["host tier"]) == output_ids(served["device only"])
    assert input_logprobs(served["host tier"]) == input_logprobs(served["device only"])
    assert output_logprobs(served["host tier"]) == output_logprobs(served["device only"])
