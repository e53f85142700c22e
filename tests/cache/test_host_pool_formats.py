"""The M3 host tier over every storage format the device pool can have, on the CPU.

For each KV dtype (fp32, bf16, fp8 stored as bytes), index-key format (the storage dtype the pool
picks, or opt-in fp8 keys with per-token fp32 scales), page size (1, 4, 16) and CPU host layout:
a backup of whole pages followed by a layer-by-layer load into other slots gives back every byte of
K, V, index keys and scales, and the size per token the host pool reports (what sizes it from
``--hicache-size`` and checks host memory with) is what it allocates per slot.
"""

from __future__ import annotations

import pytest
import torch

from sglang_m3.cache.host_pool import CPU_HOST_LAYOUTS, M3IndexedKVPoolHost
from sglang_m3.cache.index_kv_pool import M3IndexedKVPool

LAYERS, SPARSE, HEADS, HEAD_DIM, INDEX_DIM, SIZE = 4, (1, 3), 2, 8, 16, 256


def device_pool(kv_dtype, fp8_index_keys, page):
    pool_class = type("Pool", (M3IndexedKVPool,), {"sparse_layer_ids": SPARSE, "index_head_dim": INDEX_DIM,
                                                   "index_key_fp8": fp8_index_keys, "model_dtype": torch.float32})
    return pool_class(size=SIZE, page_size=page, dtype=kv_dtype, head_num=HEADS, head_dim=HEAD_DIM, layer_num=LAYERS,
                      device="cpu", enable_memory_saver=False)


def fill(pool, seed):
    """Random K/V bytes and index keys (through the pool, so fp8 keys get their scales) in every slot."""
    generator = torch.Generator().manual_seed(seed)
    for buffer in (*pool.k_buffer, *pool.v_buffer):
        buffer.view(torch.uint8).copy_(torch.randint(0, 120, buffer.view(torch.uint8).shape, generator=generator,
                                                     dtype=torch.uint8))
    slots = torch.arange(pool.size + pool.page_size)
    for layer in SPARSE:
        pool.set_index_k(layer, slots, torch.randn(len(slots), INDEX_DIM, generator=generator) * 5)


def stored_bytes(pool, slots) -> list[torch.Tensor]:
    buffers = [*pool.k_buffer, *pool.v_buffer, *pool.index_k_buffer.values(), *pool.index_k_scale_buffer.values()]
    return [buffer[slots].clone().view(torch.uint8) for buffer in buffers]


@pytest.mark.parametrize("layout", CPU_HOST_LAYOUTS)
@pytest.mark.parametrize("page", [1, 4, 16])
@pytest.mark.parametrize("fp8_index_keys", [False, True], ids=["storage-dtype-keys", "fp8-keys"])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_round_trip_through_the_host_gives_back_every_byte(kv_dtype, fp8_index_keys, page, layout):
    pool = device_pool(kv_dtype, fp8_index_keys, page)
    fill(pool, seed=0)
    host = M3IndexedKVPoolHost(pool, 2.0, 0, page, layout)
    pages = 3
    source = torch.arange(page, page + pages * page)  # whole pages after the padding page
    host_slots = torch.arange(2 * page, 2 * page + pages * page)
    before = stored_bytes(pool, source)

    host.backup_from_device_all_layer(pool, host_slots, source, "kernel")
    fill(pool, seed=1)  # other traffic rewrites every device slot
    target = torch.arange(10 * page, 10 * page + pages * page)
    for layer in range(LAYERS):
        host.load_to_device_per_layer(pool, host_slots, target, layer, "kernel")
    for i, (want, got) in enumerate(zip(before, stored_bytes(pool, target))):
        assert torch.equal(want, got), f"buffer {i} differs after the round trip"


@pytest.mark.parametrize("fp8_index_keys", [False, True], ids=["storage-dtype-keys", "fp8-keys"])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_reported_size_per_token_is_what_each_host_slot_holds(kv_dtype, fp8_index_keys):
    pool = device_pool(kv_dtype, fp8_index_keys, 4)
    host = M3IndexedKVPoolHost(pool, 2.0, 0, 4, "page_first")
    scales = host.index_k_scale_host.nbytes if fp8_index_keys else 0
    assert host.get_size_per_token() * host.size == host.kv_buffer.nbytes + host.index_k_host.nbytes + scales
