"""fp8 index keys in the KV pools (CPU): what the pool stores, that every slot copy carries the
scales with the keys (moves, CPU copies, the host tier), the server switch, and the byte counts
the memory fit and SGLang's pool sizing use."""

from __future__ import annotations

import pytest
import torch
from msa_kernels.reference import MSAParams, dequantize_index_keys, quantize_index_keys
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope

from sglang_m3.cache.host_pool import M3IndexedKVPoolHost
from sglang_m3.cache.index_key_dtype import index_key_dtype
from sglang_m3.cache.index_kv_pool import M3IndexedKVPool, index_bytes_per_token, indexed_pool_class
from sglang_m3.msa.backend import attend_paged
from sglang_m3.msa.plan import MSABatchPlan, RequestPlan
from sglang_m3.recipe.fit import estimate_fit
from sglang_m3.recipe.model_geometry import M3
from sglang_m3.recipe.render import INDEX_KEY_DTYPE_ENV
from tests.recipe.recipe_factory import make_recipe

LAYERS, SPARSE, HEADS, HEAD_DIM, INDEX_DIM, PAGE = 4, (1, 2, 3), 2, 4, 8, 4


def fp8_pool(size=64):
    pool_class = type("Pool", (M3IndexedKVPool,), {"sparse_layer_ids": SPARSE, "index_head_dim": INDEX_DIM, "index_key_fp8": True})
    pool = pool_class(size=size, page_size=PAGE, dtype=torch.float32, head_num=HEADS, head_dim=HEAD_DIM, layer_num=LAYERS,
                      device="cpu", enable_memory_saver=False)
    gen = torch.Generator().manual_seed(0)
    for layer in SPARSE:
        pool.set_index_k(layer, torch.arange(pool.size + PAGE), torch.randn(pool.size + PAGE, INDEX_DIM, generator=gen) * 3)
    return pool


def test_pool_stores_quantized_keys_and_scales():
    pool = fp8_pool()
    assert pool.index_dtype == torch.float8_e4m3fn
    keys = torch.randn(3, INDEX_DIM) * torch.tensor([[1e-3], [1.0], [500.0]])
    loc = torch.tensor([5, 9, 17])
    pool.set_index_k(2, loc, keys)
    want_keys, want_scales = quantize_index_keys(keys)
    assert torch.equal(pool.get_index_k_buffer(2)[loc].float(), want_keys.float())
    assert torch.equal(pool.get_index_k_scale_buffer(2)[loc], want_scales)
    # per sparse layer and slot: 8 fp8 bytes + a 4-byte scale
    assert pool.index_k_size_bytes() == len(SPARSE) * (pool.size + PAGE) * (INDEX_DIM + 4)


def test_slot_copies_carry_the_scales(monkeypatch):
    # SGLang's own K/V move is a GPU kernel; only the index part (this pool's override) is under test
    monkeypatch.setattr(MHATokenToKVPool, "move_kv_cache", lambda self, tgt, src: None)
    pool = fp8_pool()
    src, tgt = torch.tensor([3, 4, 10]), torch.tensor([30, 31, 40])
    before = {layer: (pool.index_k_buffer[layer][src].clone(), pool.index_k_scale_buffer[layer][src].clone()) for layer in SPARSE}
    pool.move_kv_cache(tgt, src)
    saved = pool.get_cpu_copy(tgt)
    for layer in SPARSE:
        assert torch.equal(pool.index_k_buffer[layer][tgt].float(), before[layer][0].float())
        assert torch.equal(pool.index_k_scale_buffer[layer][tgt], before[layer][1])
        pool.index_k_buffer[layer].zero_()
        pool.index_k_scale_buffer[layer].zero_()
    pool.load_cpu_copy(saved, tgt)
    for layer in SPARSE:
        assert torch.equal(pool.index_k_scale_buffer[layer][tgt], before[layer][1])
        assert torch.equal(pool.index_k_buffer[layer][tgt].float(), before[layer][0].float())


def test_host_tier_round_trip_carries_the_scales():
    pool = fp8_pool()
    host = M3IndexedKVPoolHost(pool, 2.0, 0, PAGE, "layer_first")
    assert host.index_bytes_per_token() == len(SPARSE) * (INDEX_DIM + 4)
    source = torch.arange(1, 21)
    host_slots = torch.randperm(host.size, generator=torch.Generator().manual_seed(1))[:20]
    want = {layer: dequantize_index_keys(pool.index_k_buffer[layer][source], pool.index_k_scale_buffer[layer][source]) for layer in SPARSE}
    host.backup_from_device_all_layer(pool, host_slots, source, "kernel")
    for layer in SPARSE:  # other traffic overwrites the device slots
        pool.set_index_k(layer, torch.arange(pool.size), torch.randn(pool.size, INDEX_DIM))
    target = torch.arange(31, 51)
    for layer in range(LAYERS):
        host.load_to_device_per_layer(pool, host_slots, target, layer, "kernel")
    for layer in SPARSE:
        assert torch.equal(dequantize_index_keys(pool.index_k_buffer[layer][target], pool.index_k_scale_buffer[layer][target]), want[layer])


class RealSpec:
    """The two fields the pool helpers read, at M3's real geometry."""

    sparse_layer_ids = tuple(i for i, is_sparse in enumerate(M3.layer_is_sparse) if is_sparse)
    index_head_dim = M3.index_key_dim


def test_switch_is_read_from_the_environment(monkeypatch):
    monkeypatch.delenv(INDEX_KEY_DTYPE_ENV, raising=False)
    assert index_key_dtype() == "bf16" and not indexed_pool_class(RealSpec).index_key_fp8
    monkeypatch.setenv(INDEX_KEY_DTYPE_ENV, "fp8_e4m3")
    assert indexed_pool_class(RealSpec).index_key_fp8
    monkeypatch.setenv(INDEX_KEY_DTYPE_ENV, "fp8")
    with pytest.raises(ValueError, match=f"{INDEX_KEY_DTYPE_ENV}='fp8': expected one of bf16, fp8_e4m3"):
        indexed_pool_class(RealSpec)


def test_fit_counts_the_bytes_the_fp8_pool_stores(monkeypatch):
    """One TP8 rank of the real geometry: 1 KV head x 60 layers + 57 fp8 index keys with scales."""
    recipe = make_recipe(spec__model={"path": "MiniMaxAI/MiniMax-M3", "variant": "bf16"}, spec__hardware={"profile": "h200"},
                         spec__parallelism={"tp": 8}, spec__contextLength=65536,
                         spec__kvCache={"pageSize": 128, "indexKeyDtype": "fp8_e4m3"},
                         spec__hostOffload={"mode": "hierarchical-cache", "sizeGbPerRank": 1})
    report = estimate_fit(recipe)
    pool_class = type("Pool", (M3IndexedKVPool,), {
        "sparse_layer_ids": RealSpec.sparse_layer_ids, "index_head_dim": M3.index_key_dim, "index_key_fp8": True})
    pool = pool_class(size=256, page_size=128, dtype=torch.bfloat16, head_num=1, head_dim=M3.head_dim,
                      layer_num=M3.num_layers, device="cpu", enable_memory_saver=False)
    with host_memory_budget_scope(2 * 10**9):
        host = M3IndexedKVPoolHost(pool, 2.0, 1, 128, "layer_first")
    assert host.get_size_per_token() == report.kv_bytes_per_token == 60 * 512 + 57 * (128 + 4) == 38_244
    # what SGLang's pool sizing adds per token (plugin hook), from the same switch
    monkeypatch.setenv(INDEX_KEY_DTYPE_ENV, "fp8_e4m3")
    assert index_bytes_per_token(RealSpec, 0, 60, torch.bfloat16) == 57 * 132
    assert index_bytes_per_token(RealSpec, 0, 60, torch.float8_e4m3fn, fp8=False) == 57 * 256


def test_torch_path_scores_the_dequantized_keys():
    """The CPU backend with fp8 keys + scales computes exactly what it computes on the dequantized keys."""
    gen = torch.Generator().manual_seed(5)
    slots, hq, hkv, d = 96, 4, 2, 8
    keys, scales = quantize_index_keys(torch.randn(slots, d, generator=gen))
    q, iq = torch.randn(20, hq, d, generator=gen), torch.randn(20, hkv, d, generator=gen)
    k, v = torch.randn(slots, hkv, d, generator=gen), torch.randn(slots, hkv, d, generator=gen)
    request = RequestPlan(query_start=0, query_len=20, kv_slots=torch.randperm(slots, generator=gen)[:70],
                          query_positions=torch.arange(50, 70))
    plan = MSABatchPlan(requests=(request,))
    params = MSAParams(block_size=8, topk=3)
    got = attend_paged(plan, q, k, v, iq, keys, params, 0.3, scales)
    want = attend_paged(plan, q, k, v, iq, dequantize_index_keys(keys, scales), params, 0.3)
    assert torch.equal(got, want)
