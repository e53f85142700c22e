"""Sparse offload's attention (CPU) equals the all-device torch path, bit for bit, on random inputs.

Two pools receive the same K/V and index keys through their backends: the plain index-key pool
with ``MSATorchBackend``, and the offload pool (host store + block caches far smaller than the
requests' blocks) with ``MSAOffloadTorchBackend``. Prompts are prefilled in chunks that end
mid-block, two requests share a radix prefix (the same slots), then every request decodes
(or verifies drafts) step after step, so the caches evict, hit shared pages, and serve the block
being written.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from forward_batch_doubles import forward_batch_for
from offload_helpers import PagedRequests

from sglang_m3.cache.index_kv_pool import indexed_pool_class
from sglang_m3.cache.offload_pool import offload_pool_class
from sglang_m3.cache.offload_settings import OffloadShape
from sglang_m3.msa.backend import MSATorchBackend
from sglang_m3.msa.offload_backend import MSAOffloadTorchBackend

LAYERS, SPARSE, HQ, HKV, D, DI, BLOCK, TOPK = 3, (1, 2), 4, 2, 8, 8, 4, 2
SIZE = 64 * BLOCK
SPEC = SimpleNamespace(sparse_layer_ids=SPARSE, index_head_dim=DI, index_block_size=BLOCK, index_topk_blocks=TOPK,
                       index_local_blocks=1, index_init_blocks=0)


def make_pool(pool_class):
    return pool_class(size=SIZE, page_size=BLOCK, dtype=torch.float32, head_num=HKV, head_dim=D, layer_num=LAYERS,
                      device="cpu", enable_memory_saver=False)


def layer(layer_id):
    return SimpleNamespace(layer_id=layer_id, tp_q_head_num=HQ, tp_k_head_num=HKV, qk_head_dim=D, v_head_dim=D,
                           scaling=D**-0.5, k_scale=None, v_scale=None)


def run_both(backends, mode, paged, reqs, query_lens, generator):
    """One forward of every sparse layer through both backends; returns their outputs."""
    fb = forward_batch_for(mode, paged.req_to_token, torch.tensor(reqs), [paged.lens[r] for r in reqs], query_lens)
    rows = sum(query_lens)
    outputs = {name: [] for name in backends}
    for layer_id in SPARSE:
        q, k, v = (torch.randn(rows, HQ if i == 0 else HKV, D, generator=generator) for i in range(3))
        iq, ik = torch.randn(rows, HKV, DI, generator=generator), torch.randn(rows, DI, generator=generator)
        for name, backend in backends.items():
            backend.init_forward_metadata(fb)
            forward = backend.forward_extend if mode == "EXTEND" else backend.forward_decode
            outputs[name].append(forward(q.view(rows, -1), k.clone(), v.clone(), layer(layer_id), fb, index_q=iq, index_k=ik))
    return outputs


@pytest.mark.parametrize("cache_blocks, q_len", [(4, 1), (9, 1), (8, 2)], ids=["one-request-rounds", "two-request-rounds", "verify-chains"])
def test_decode_through_a_small_block_cache_equals_the_device_pool(cache_blocks, q_len):
    generator = torch.Generator().manual_seed(cache_blocks)
    shape = OffloadShape(cache_blocks=cache_blocks, block_size=BLOCK, topk=TOPK, kv_heads=HKV, max_query_tokens=q_len)
    pools = {"device": make_pool(indexed_pool_class(SPEC, torch.float32)),
             "offload": make_pool(offload_pool_class(SPEC, torch.float32, shape))}
    paged = PagedRequests(SIZE, BLOCK, 256, shared_pages=5, generator=generator)
    runner = lambda pool: SimpleNamespace(req_to_token_pool=SimpleNamespace(req_to_token=paged.req_to_token), token_to_kv_pool=pool)
    backends = {"device": MSATorchBackend(runner(pools["device"]), SPEC),
                "offload": MSAOffloadTorchBackend(runner(pools["offload"]), SPEC)}

    # prefill in chunks ending mid-block; request 1 reuses request 0's first 5 pages (a radix hit)
    for req, chunks in ((0, (30, 27)), (1, (41,)), (2, (19, 30))):
        for i, chunk in enumerate(chunks):
            if req == 1 and i == 0:
                paged.lens[1] = 20  # the shared prefix is cached already
            paged.grow(req, chunk)
            out = run_both(backends, "EXTEND", paged, [req], [chunk], generator)
            for a, b in zip(out["device"], out["offload"]):
                assert torch.equal(a, b)

    mode = "DECODE" if q_len == 1 else "TARGET_VERIFY"
    for _ in range(6):
        for req in range(3):
            paged.grow(req, q_len)
        out = run_both(backends, mode, paged, [0, 1, 2], [q_len] * 3, generator)
        for a, b in zip(out["device"], out["offload"]):
            assert torch.equal(a, b)

    counters = pools["offload"].offload_counters()
    assert counters["misses"] > 0
    if shape.requests_per_round > 1:  # room for pages to stay resident from one step to the next
        assert counters["hits"] > 0
    assert counters["h2d_bytes"] == counters["misses"] * BLOCK * HKV * 2 * D * 4
    for cache in pools["offload"].block_caches.values():
        assert int((cache.page_entry[: cache.num_pages] >= 0).sum()) <= cache_blocks


def test_offloaded_layers_live_in_the_host_store_and_others_on_the_device():
    shape = OffloadShape(cache_blocks=4, block_size=BLOCK, topk=TOPK, kv_heads=HKV, max_query_tokens=1)
    pool = make_pool(offload_pool_class(SPEC, torch.float32, shape))
    assert set(pool.block_caches) == set(SPARSE)
    assert pool.block_cache(1).k_pages.shape == (5, BLOCK, HKV, D)  # 4 entries + the scratch entry
    assert pool.get_key_buffer(1).shape == (SIZE + BLOCK, HKV, D)  # every slot, in the host store
    assert pool.get_index_k_buffer(1).shape == (SIZE + BLOCK, DI)


def test_slot_moves_invalidate_the_pages_they_write():
    shape = OffloadShape(cache_blocks=4, block_size=BLOCK, topk=TOPK, kv_heads=HKV, max_query_tokens=1)
    pool = make_pool(offload_pool_class(SPEC, torch.float32, shape))
    pool.use_native_move_kv_cache = True  # SGLang's torch slot move, as the CPU platform sets it
    wanted = torch.tensor([3, 7, -1, -1])
    for layer_id in SPARSE:
        pool.fetch_pages(layer_id, wanted)
    pool.move_kv_cache(torch.tensor([7 * BLOCK + 1]), torch.tensor([2 * BLOCK]))
    for cache in pool.block_caches.values():
        assert int(cache.page_entry[3]) >= 0 and int(cache.page_entry[7]) == -1
