"""The M3 host pool against a real ``M3IndexedKVPool`` on the CPU: K/V and index keys travel
together, slot for slot, in SGLang's backup (all layers) and load (one layer) calls."""

from __future__ import annotations

import types

import pytest
import torch
from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

from sglang_m3.cache.host_pool import M3HostStackStrategy, M3IndexedKVPoolHost, _refuse_unsupported, register_m3_host_stack
from sglang_m3.cache.index_kv_pool import M3IndexedKVPool

LAYERS, SPARSE, HEADS, HEAD_DIM, INDEX_DIM, PAGE = 4, (1, 2, 3), 2, 4, 8, 4


def device_pool(size=64, dtype=torch.float32):
    pool_class = type("Pool", (M3IndexedKVPool,), {"sparse_layer_ids": SPARSE, "index_head_dim": INDEX_DIM})
    pool = pool_class(size=size, page_size=PAGE, dtype=dtype, head_num=HEADS, head_dim=HEAD_DIM, layer_num=LAYERS,
                      device="cpu", enable_memory_saver=False)
    return randomize(pool, seed=0)


def randomize(pool, seed):
    generator = torch.Generator().manual_seed(seed)
    for buffer in (*pool.k_buffer, *pool.v_buffer, *pool.index_k_buffer.values()):
        buffer.copy_(torch.randn(buffer.shape, generator=generator).to(buffer.dtype))
    return pool


def snapshot(pool, layer, slots):
    index = pool.index_k_buffer[layer][slots].clone() if layer in pool.index_k_buffer else None
    return pool.k_buffer[layer][slots].clone(), pool.v_buffer[layer][slots].clone(), index


def assert_same(left, right):
    for a, b in zip(left, right):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_backup_then_per_layer_load_moves_kv_and_index_keys_together(layout):
    pool = device_pool()
    host = M3IndexedKVPoolHost(pool, 2.0, 0, PAGE, layout)
    generator = torch.Generator().manual_seed(1)
    source = torch.randperm(pool.size, generator=generator)[:20] + 1  # slot 0 is SGLang's padding slot
    host_slots = torch.randperm(host.size, generator=generator)[:20]
    before = {layer: snapshot(pool, layer, source) for layer in range(LAYERS)}

    host.backup_from_device_all_layer(pool, host_slots, source, "kernel")
    for row, layer in enumerate(SPARSE):
        assert torch.equal(host.index_k_host[row][host_slots], before[layer][2])
    for layer in range(LAYERS):
        assert torch.equal(host.k_data_refs[layer][host_slots], before[layer][0])

    # Other traffic overwrites the device pool; the prefix comes back into different slots.
    fresh = randomize(pool, seed=7)
    target = torch.randperm(pool.size, generator=generator)[:20] + 1
    untouched = {layer: snapshot(fresh, layer, target) for layer in range(LAYERS)}
    for layer in range(LAYERS):
        host.load_to_device_per_layer(fresh, host_slots, target, layer, "kernel")
        assert_same(snapshot(fresh, layer, target), before[layer])
        for later in range(layer + 1, LAYERS):  # one layer per call: later layers still untouched
            assert_same(snapshot(fresh, later, target), untouched[later])


def test_host_size_counts_index_keys_and_follows_hicache_size():
    pool = device_pool(dtype=torch.bfloat16)
    host = M3IndexedKVPoolHost(pool, 2.0, 1, PAGE, "layer_first")  # --hicache-size 1 (GB)
    kv_bytes = 2 * LAYERS * HEADS * HEAD_DIM * 2
    index_bytes = len(SPARSE) * INDEX_DIM * 2
    assert host.get_size_per_token() == kv_bytes + index_bytes
    assert host.size == (int(1e9 // (kv_bytes + index_bytes)) // PAGE + 1) * PAGE
    assert host.index_k_host.shape == (len(SPARSE), host.size, INDEX_DIM)
    assert host.index_k_host.dtype == torch.bfloat16


def test_host_budget_beyond_free_memory_is_refused_before_allocating():
    # What a server started with --hicache-size 100000 logs before exiting (measured once on the
    # CPU server; checked here without a server start).
    with pytest.raises(ValueError, match=r"Not enough host memory available\. Requesting 100000\.00 GB"):
        M3IndexedKVPoolHost(device_pool(), 2.0, 100000, PAGE, "layer_first")


def test_unsupported_cpu_layout_is_refused_by_flag_name():
    with pytest.raises(ValueError, match="--hicache-mem-layout page_first_direct"):
        M3IndexedKVPoolHost(device_pool(), 2.0, 0, PAGE, "page_first_direct")


def test_sglang_picks_the_m3_stack_for_the_m3_pool_only():
    register_m3_host_stack()
    register_m3_host_stack()  # once per process, however often the plugin registers
    assert sum(isinstance(s, M3HostStackStrategy) for s in hybrid_pool_assembler._STRATEGIES) == 1
    full = {ComponentType.FULL}
    assert isinstance(hybrid_pool_assembler._select_strategy(device_pool(), full), M3HostStackStrategy)
    plain = MHATokenToKVPool(size=16, page_size=PAGE, dtype=torch.float32, head_num=HEADS, head_dim=HEAD_DIM,
                             layer_num=LAYERS, device="cpu", enable_memory_saver=False)
    assert not isinstance(hybrid_pool_assembler._select_strategy(plain, full), M3HostStackStrategy)


@pytest.mark.parametrize("change, flag", [
    ({"storage_backend": "file"}, "--hicache-storage-backend file"),
    ({"mode": "buffer_only"}, "--hicache-host-memory-mode buffer_only"),
    ({"mtp_draft_device_pools": (object(),)}, "speculative draft"),
    ({"pp_size": 2}, "--pp-size"),
])
def test_unsupported_combinations_are_refused_by_flag_name(change, flag):
    params = types.SimpleNamespace(mtp_draft_device_pools=change.get("mtp_draft_device_pools", ()),
                                   sidecar_draft_device_pools=(), pp_size=change.get("pp_size", 1))
    with pytest.raises(ValueError, match=flag):
        _refuse_unsupported(change.get("storage_backend"), change.get("mode", "cache"), params, device_pool())
