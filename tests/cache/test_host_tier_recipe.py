"""Recipes with ``hostOffload``: which modes the rules accept, and the memory fit's host tier
checked against the host pool SGLang really builds for the M3 pool."""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope

from sglang_m3.cache.host_pool import M3IndexedKVPoolHost
from sglang_m3.cache.index_kv_pool import M3IndexedKVPool
from sglang_m3.recipe import validate_recipe
from sglang_m3.recipe.fit import estimate_fit
from sglang_m3.recipe.model_geometry import M3
from tests.recipe.recipe_factory import make_recipe

CPU = dict(spec__model={"path": "sglang-m3:tiny", "variant": "bf16"}, spec__hardware={"profile": "cpu"},
           spec__parallelism={"tp": 1}, spec__contextLength=4096, spec__kvCache={"pageSize": 1},
           spec__serving={"maxTotalTokens": 8192, "maxRunningRequests": 4})
H200_TP8 = dict(spec__model={"path": "MiniMaxAI/MiniMax-M3", "variant": "bf16"}, spec__hardware={"profile": "h200"},
                spec__parallelism={"tp": 8}, spec__contextLength=65536)


def findings(**changes):
    return {(f.rule, f.field) for f in validate_recipe(make_recipe(**changes)) if f.severity == "error"}


def test_hierarchical_cache_is_accepted_on_the_cpu_profile():
    assert findings(**CPU, spec__hostOffload={"mode": "hierarchical-cache", "sizeGbPerRank": 1}) == set()


def test_hisparse_is_refused_by_mode_on_every_profile():
    # The server refuses --enable-hisparse: SGLang's HiSparse keys on the upstream M3 wiring
    # (is_minimax_sparse) that the plugin turns off; measured on the CPU server, the check runs
    # at argument validation, before any device code, so it holds on GPUs too.
    hisparse = {"mode": "hisparse", "hostToDeviceRatio": 2.0}
    for profile in (CPU, H200_TP8):
        assert ("offload.hisparse", "spec.hostOffload.mode") in findings(**profile, spec__hostOffload=hisparse)


def test_fit_host_tier_is_the_host_pool_sglang_builds():
    recipe = make_recipe(**H200_TP8, spec__kvCache={"pageSize": 128},
                         spec__hostOffload={"mode": "hierarchical-cache", "sizeGbPerRank": 1})
    report = estimate_fit(recipe)
    # One TP8 rank of the real geometry: 1 KV head (4 heads over 8 ranks), 60 layers, the index
    # key of every sparse layer, bf16; a small device pool is enough, the host pool is sized by GB.
    pool_class = type("Pool", (M3IndexedKVPool,), {
        "sparse_layer_ids": tuple(i for i, sparse in enumerate(M3.layer_is_sparse) if sparse),
        "index_head_dim": M3.index_key_dim})
    pool = pool_class(size=256, page_size=128, dtype=torch.bfloat16, head_num=1, head_dim=M3.head_dim,
                      layer_num=M3.num_layers, device="cpu", enable_memory_saver=False)
    with host_memory_budget_scope(2 * 10**9):
        host = M3IndexedKVPoolHost(pool, 2.0, 1, 128, "layer_first")
    assert host.get_size_per_token() == report.kv_bytes_per_token == 45_312
    assert host.size == report.host_pool_tokens
    assert ("host tier tokens (KV + index keys)", f"{host.size:,} (1.00 GB sizeGbPerRank)") in report.rows()
    # 1 GB holds ~22K tokens, far below the GPU pool: the fit says so, naming the field.
    warning = [f for f in report.findings() if f.rule == "fit.host-tier"]
    assert warning and warning[0].field == "spec.hostOffload.sizeGbPerRank"
    assert report.host_pool_tokens < report.pool_tokens


def test_no_host_tier_without_hierarchical_cache():
    report = estimate_fit(make_recipe(**H200_TP8))
    assert report.host_pool_bytes == report.host_pool_tokens == 0
    assert not any(row[0].startswith("host tier") for row in report.rows())
