"""M3 on SGLang's hierarchical cache, served for real on the CPU platform from a recipe.

One server: ``sglang-m3 serve`` of the cpu-tiny recipe with ``hostOffload`` (hierarchical-cache,
1 GB per rank) and a 1024-token GPU ("device") pool. A 300-token prefix (18 MSA blocks of the
tiny model's 16 and 12 tokens, so the cached prefix ends mid-block; top-4 blocks, so the sparse
selection drops most of it) is served, pushed out of the device pool by other traffic, and reused
from the host: the host must give back its K/V and index keys, or MSA would pick blocks with the
keys of the traffic that overwrote those slots. Greedy tokens are compared with transformers and
with the session's server without a host tier.
"""

from __future__ import annotations

import re

import pytest
import requests
import yaml
from server_harness import serve_tiny_recipe
from transformers_oracle import random_prompt

from tests.e2e.served_vs_reference import assert_matches_reference, generate, output_ids
from tests.recipe.recipe_factory import LIBRARY

pytestmark = pytest.mark.server

DEVICE_TOKENS = 1024
PREFIX = random_prompt(21, 300)


def hicache_recipe(path) -> str:
    document = yaml.safe_load((LIBRARY / "cpu-tiny.yaml").read_text())
    document["metadata"]["name"] = "cpu-tiny-hicache"
    document["spec"]["contextLength"] = DEVICE_TOKENS
    document["spec"]["serving"].update(maxTotalTokens=DEVICE_TOKENS, chunkedPrefillSize=100)
    document["spec"]["hostOffload"] = {"mode": "hierarchical-cache", "sizeGbPerRank": 1}
    path.write_text(yaml.safe_dump(document))
    return str(path)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(server, tiny checkpoint dir) of ``sglang-m3 serve`` on the hostOffload recipe."""
    root = tmp_path_factory.mktemp("hicache")
    # observability only: the recipe renders the serving flags under test
    with serve_tiny_recipe(hicache_recipe(root / "recipe.yaml"), root,
                           "--enable-metrics", "--enable-cache-report", "--sleep-on-idle") as server:
        yield server, server.model_path


def test_recipe_flags_reach_sglang_and_build_the_m3_host_pool(served):
    server, _ = served
    log = open(server.log_path, encoding="utf-8").read()
    # SGLang resolved the flags the recipe rendered
    assert "'enable_hierarchical_cache': True," in log and "'hicache_size': 1," in log
    assert re.search(r"Allocating kv\+index hierarchical KV host pool: \d+ tokens, 1\.00 GB", log)
    assert "pools=KV + M3 index keys" in log and "hicache_attached=True" in log


def test_prefix_evicted_to_host_and_reused_matches_transformers(served, tiny_m3_server):
    server, model_dir = served
    generate(server, PREFIX + random_prompt(22, 20))
    for seed in range(3):  # 3 x 400 tokens through a 1024-token device pool evict the prefix
        generate(server, random_prompt(30 + seed, 400))
    second = PREFIX + random_prompt(23, 30)
    result = generate(server, second, logprob_start=len(PREFIX))

    assert result["meta_info"]["cached_tokens_details"] == {"device": 0, "host": len(PREFIX)}
    assert_matches_reference(server, model_dir, second, "host-tier hit", result=result)
    assert output_ids(result) == output_ids(generate(tiny_m3_server, second)), "differs from the server without a host tier"

    metrics = requests.get(f"{server.base_url}/metrics", timeout=300).text
    host_hits = re.search(r'sglang:prefill_effective_tokens_total\{[^}]*mode="host_hit"[^}]*\} ([0-9.]+)', metrics)
    assert host_hits and float(host_hits.group(1)) >= len(PREFIX)
    assert f"#cached-token: {len(PREFIX)}" in open(server.log_path, encoding="utf-8").read()


def test_request_longer_than_the_tiers_hold_gets_a_clear_error(served):
    # Every running token sits in the device pool (the host tier only keeps evicted prefixes),
    # and the recipe rules keep contextLength <= maxTotalTokens, so the context check is the limit.
    server, _ = served
    response = requests.post(f"{server.base_url}/generate", timeout=900, json={
        "input_ids": random_prompt(5, 1500), "sampling_params": {"max_new_tokens": 4}})
    assert response.status_code == 400
    assert f"The input (1500 tokens) is longer than the model's context length ({DEVICE_TOKENS} tokens)" in response.text
    assert requests.get(f"{server.base_url}/health_generate", timeout=900).status_code == 200

