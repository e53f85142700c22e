"""The index-key cache under a tight device pool, served for real on the CPU platform.

Index keys ride on SGLang's slot ids, so every path that reuses, frees or refills slots must leave
a token's index key beside its own K/V. One server runs the tiny M3 (MSA blocks of 16, top-4) with
a 1,024-token pool and prefill chunks of 100 tokens (chunks end mid-block), so prompts of a few
hundred tokens push each other's prefixes out and later requests reuse slots other requests
wrote. The checks put radix hits exactly on a block boundary and mid-block, re-hit a prefix after
the pool evicted it, and share one prefix among concurrent requests that do not all fit at once.
Greedy tokens and prompt logprobs are compared with transformers' M3 (the oracle): a stale index
key changes which blocks MSA selects, and so the logprobs of the positions past the top-k window.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from server_harness import launch_cpu_server
from transformers_oracle import random_prompt

from tests.e2e.served_vs_reference import assert_matches_reference, generate, output_ids

pytestmark = pytest.mark.server

BLOCK = 16
POOL_TOKENS = 1024
TIGHT_FLAGS = ("--max-total-tokens", str(POOL_TOKENS), "--context-length", str(POOL_TOKENS),
               "--chunked-prefill-size", "100")


@pytest.fixture(scope="module")
def tight_server(tiny_m3_checkpoint, server_log_dir):
    with launch_cpu_server(tiny_m3_checkpoint, server_log_dir, *TIGHT_FLAGS) as server:
        yield server


def evict_everything(server, seed: int) -> None:
    """Three prompts of 400 tokens: together more than the pool, so every older prefix is evicted."""
    for i in range(3):
        generate(server, random_prompt(seed + i, 400), max_new_tokens=1)


def test_radix_hit_on_a_block_boundary_matches_transformers(tight_server, tiny_m3_checkpoint):
    shared = random_prompt(101, 13 * BLOCK)  # the cached prefix ends exactly where block 13 starts
    generate(tight_server, shared + random_prompt(102, 40))
    second = shared + random_prompt(103, 150)
    result = generate(tight_server, second, logprob_start=len(shared))
    assert result["meta_info"]["cached_tokens"] >= len(shared)
    assert_matches_reference(tight_server, tiny_m3_checkpoint, second, "hit on a block boundary", result=result)


def test_prefix_evicted_then_served_again_matches_transformers(tight_server, tiny_m3_checkpoint):
    prefix = random_prompt(111, 300)  # 18 blocks and 12 tokens
    first = generate(tight_server, prefix + random_prompt(112, 20))
    evict_everything(tight_server, 120)
    again = prefix + random_prompt(113, 30)
    result = generate(tight_server, again, logprob_start=0)
    assert result["meta_info"]["cached_tokens"] == 0, "the prefix was not evicted: the check would prove nothing"
    assert_matches_reference(tight_server, tiny_m3_checkpoint, again, "re-prefill into evicted slots", result=result)
    assert output_ids(first) == output_ids(generate(tight_server, prefix + random_prompt(112, 20)))


def test_partly_evicted_prefix_hits_mid_block_and_matches_transformers(tight_server, tiny_m3_checkpoint):
    head = random_prompt(131, 150)  # 9 blocks and 6 tokens: the surviving hit ends mid-block
    generate(tight_server, head + random_prompt(132, 200))
    generate(tight_server, head + random_prompt(133, 60))  # splits the tree at the head
    # 700 new tokens: the LRU tails go, the head (used last) stays
    generate(tight_server, random_prompt(134, 700), max_new_tokens=1)
    second = head + random_prompt(135, 180)
    result = generate(tight_server, second, logprob_start=len(head))
    assert len(head) <= result["meta_info"]["cached_tokens"] < len(head) + 60
    assert_matches_reference(tight_server, tiny_m3_checkpoint, second, "mid-block hit after eviction", result=result)


def test_concurrent_requests_sharing_a_prefix_beyond_the_pool_match_transformers(tight_server, tiny_m3_checkpoint):
    shared = random_prompt(141, 203)  # 12 blocks and 11 tokens
    prompts = [shared + random_prompt(150 + i, 140 + 23 * i) for i in range(6)]  # 2,000+ tokens in all
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: generate(tight_server, p, logprob_start=len(shared)), prompts))
    for i, (prompt, result) in enumerate(zip(prompts, results)):
        assert_matches_reference(tight_server, tiny_m3_checkpoint, prompt, f"concurrent sharer {i}", result=result)
