"""Recipes with ``hostOffload.mode: sparse-offload``: rules, rendered environment, the two-tier fit
(checked against the offload pool the plugin builds), and ``sglang-m3 serve`` answering a request."""

from __future__ import annotations

import re

import pytest
import torch
import yaml
from server_harness import serve_tiny_recipe
from transformers_oracle import random_prompt

from sglang_m3.cache.offload_pool import offload_pool_class
from sglang_m3.cache.offload_settings import OffloadShape
from sglang_m3.recipe import render_launch, validate_recipe
from sglang_m3.recipe.fit import estimate_fit, kv_bytes_per_token
from sglang_m3.recipe.model_geometry import M3
from sglang_m3.recipe.render import SPARSE_OFFLOAD_BLOCKS_ENV, SPARSE_OFFLOAD_HOST_GB_ENV
from tests.e2e.served_vs_reference import generate, output_ids
from tests.recipe.recipe_factory import LIBRARY, make_recipe

CPU = dict(spec__model={"path": "sglang-m3:tiny", "variant": "bf16"}, spec__hardware={"profile": "cpu"},
           spec__parallelism={"tp": 1}, spec__contextLength=4096, spec__kvCache={"pageSize": 16},
           spec__serving={"maxTotalTokens": 8192, "maxRunningRequests": 4})
H200_TP8 = dict(spec__model={"path": "MiniMaxAI/MiniMax-M3", "variant": "bf16"}, spec__hardware={"profile": "h200"},
                spec__parallelism={"tp": 8}, spec__contextLength=131072, spec__kvCache={"pageSize": 128})
MI300X_TP8 = dict(spec__model={"path": "MiniMaxAI/MiniMax-M3", "variant": "mxfp8"}, spec__hardware={"profile": "mi300x"},
                  spec__parallelism={"tp": 8, "ep": 8}, spec__contextLength=131072, spec__kvCache={"pageSize": 128})
SPARSE_OFFLOAD = {"mode": "sparse-offload", "sizeGbPerRank": 1, "cacheBlocks": 16}


def errors(**changes):
    return {(f.rule, f.field) for f in validate_recipe(make_recipe(**changes)) if f.severity == "error"}


def test_sparse_offload_is_accepted_on_the_cpu_profile_and_renders_its_environment():
    recipe = make_recipe(**CPU, spec__hostOffload=SPARSE_OFFLOAD)
    assert errors(**CPU, spec__hostOffload=SPARSE_OFFLOAD) == set()
    launch = render_launch(recipe)
    assert launch.env[SPARSE_OFFLOAD_BLOCKS_ENV] == "16" and launch.env[SPARSE_OFFLOAD_HOST_GB_ENV] == "1"
    assert not any("hicache" in arg or "hisparse" in arg or "radix" in arg for arg in launch.argv)


@pytest.mark.parametrize("offload, profile, expected", [
    ({"mode": "sparse-offload", "sizeGbPerRank": 1}, CPU, ("offload.cache-blocks", "spec.hostOffload.cacheBlocks")),
    ({"mode": "sparse-offload", "cacheBlocks": 16}, CPU, ("offload.size", "spec.hostOffload.sizeGbPerRank")),
    ({"mode": "hierarchical-cache", "sizeGbPerRank": 1, "cacheBlocks": 16}, CPU,
     ("offload.mode-field", "spec.hostOffload.cacheBlocks")),
    (SPARSE_OFFLOAD, MI300X_TP8, ("offload.sparse-gpu", "spec.hostOffload.mode")),
])
def test_incomplete_or_unservable_sparse_offload_is_an_error(offload, profile, expected):
    assert expected in errors(**profile, spec__hostOffload=offload)


def test_sparse_offload_is_accepted_on_nvidia_gpus():
    assert not {rule for rule, _ in errors(**H200_TP8, spec__hostOffload=SPARSE_OFFLOAD)} & {"offload.sparse-gpu"}


def test_fit_counts_the_host_store_and_the_block_caches_as_the_pool_allocates_them():
    offload = {"mode": "sparse-offload", "sizeGbPerRank": 200, "cacheBlocks": 256}
    report = estimate_fit(make_recipe(**H200_TP8, spec__hostOffload=offload))
    plain = estimate_fit(make_recipe(**H200_TP8))
    # One TP8 rank: 1 KV head, 57 sparse layers x (K + V) x 128 x bf16 leave the GPU
    host_per_token = 57 * 2 * 128 * 2
    assert report.host_store_bytes_per_token == host_per_token
    assert report.kv_bytes_per_token == kv_bytes_per_token("auto", 8, 1) - host_per_token == plain.kv_bytes_per_token - host_per_token
    assert report.block_cache_bytes == (256 + 1) * 128 * host_per_token  # the entries and the scratch entry
    assert report.host_store_tokens == (200 * 10**9 // host_per_token // 128 - 1) * 128
    assert report.pool_tokens == min(report.host_store_tokens, report.kv_pool_bytes // report.kv_bytes_per_token // 128 * 128)
    # the GPU keeps index keys (one head, replicated on every rank) and dense K/V: 16,128 instead of
    # 45,312 bytes per token at TP8, 2.1x the tokens after the block caches (at TP1: 20,736 vs 137,472)
    assert report.kv_bytes_per_token == 16128 and report.pool_tokens > 2 * plain.pool_tokens

    sparse = tuple(i for i, is_sparse in enumerate(M3.layer_is_sparse) if is_sparse)
    spec = type("Spec", (), {"sparse_layer_ids": sparse, "index_head_dim": M3.index_key_dim})
    shape = OffloadShape(cache_blocks=256, block_size=128, topk=16, kv_heads=1, max_query_tokens=1)
    pool = offload_pool_class(spec, torch.bfloat16, shape)(
        size=1024, page_size=128, dtype=torch.bfloat16, head_num=1, head_dim=M3.head_dim, layer_num=M3.num_layers,
        device="cpu", enable_memory_saver=False)
    host_bytes = sum(pool.k_buffer[layer].nbytes + pool.v_buffer[layer].nbytes for layer in sparse)
    assert host_bytes == (1024 + 128) * report.host_store_bytes_per_token
    cache_bytes = sum(cache.k_pages.nbytes + cache.v_pages.nbytes for cache in pool.block_caches.values())
    assert cache_bytes == report.block_cache_bytes


def sparse_offload_recipe(path) -> str:
    document = yaml.safe_load((LIBRARY / "cpu-tiny.yaml").read_text())
    document["metadata"]["name"] = "cpu-tiny-sparse-offload"
    document["spec"]["kvCache"]["pageSize"] = 16
    document["spec"]["serving"]["chunkedPrefillSize"] = 112
    document["spec"]["hostOffload"] = SPARSE_OFFLOAD
    path.write_text(yaml.safe_dump(document))
    return str(path)


@pytest.mark.server
def test_sglang_m3_serve_of_a_sparse_offload_recipe_answers_as_the_device_server(tmp_path, tiny_m3_server):
    with serve_tiny_recipe(sparse_offload_recipe(tmp_path / "recipe.yaml"), tmp_path, "--sleep-on-idle") as server:
        prompt = random_prompt(80, 600)
        assert output_ids(generate(server, prompt)) == output_ids(generate(tiny_m3_server, prompt))
        log = open(server.log_path, encoding="utf-8").read()
        assert "'page_size': 16," in log  # SGLang resolved the page size the recipe rendered
        assert re.search(r"M3 sparse offload: 3 sparse layers' K/V in a host store of 8208 slots \(\S+ GB\), "
                         r"block caches of 16 blocks per layer", log)
