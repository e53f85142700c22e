"""Sparse offload when a finished request's pages go to a new request while they sit in the block cache.

The block cache is keyed by host page, not by request. When a request ends, SGLang's paged allocator
hands its pages to the next request, whose prefill then writes new K/V (and index keys) into slots
whose old K/V may still be resident in a cache entry. Every such write must reach the entry
(write-through), or the new request's decode would attend the old request's K/V. Two pools receive
the same tokens through their backends: the plain index-key pool (``MSATorchBackend``, the oracle)
and the offload pool (``MSAOffloadTorchBackend``, a cache of one request's selection), under every
index-key format (model dtype, fp8 with scales) and KV dtype (fp32, bf16, fp8); outputs must be
identical bit for bit.
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
#: one request's decode selection per round (top-2 of 2 heads): the last request decoded owns the cache
SHAPE = OffloadShape(cache_blocks=TOPK * HKV, block_size=BLOCK, topk=TOPK, kv_heads=HKV, max_query_tokens=1)


def pool_classes(fp8_index_keys: bool):
    device, offload = indexed_pool_class(SPEC, torch.float32), offload_pool_class(SPEC, torch.float32, SHAPE)
    if fp8_index_keys:
        device = type("Pool", (device,), {"index_key_fp8": True})
        offload = type("Pool", (offload,), {"index_key_fp8": True})
    return device, offload


def layer(layer_id):
    return SimpleNamespace(layer_id=layer_id, tp_q_head_num=HQ, tp_k_head_num=HKV, qk_head_dim=D, v_head_dim=D,
                           scaling=D**-0.5, k_scale=None, v_scale=None)


class Twins:
    """The oracle and the offload backend, fed the same random tokens step after step."""

    def __init__(self, fp8_index_keys: bool, kv_dtype: torch.dtype, generator):
        self.generator = generator
        self.paged = PagedRequests(SIZE, BLOCK, 256, shared_pages=0, generator=generator)
        self.pools = {name: cls(size=SIZE, page_size=BLOCK, dtype=kv_dtype, head_num=HKV, head_dim=D, layer_num=LAYERS,
                                device="cpu", enable_memory_saver=False)
                      for name, cls in zip(("device", "offload"), pool_classes(fp8_index_keys))}
        runner = lambda pool: SimpleNamespace(  # noqa: E731
            req_to_token_pool=SimpleNamespace(req_to_token=self.paged.req_to_token), token_to_kv_pool=pool)
        self.backends = {"device": MSATorchBackend(runner(self.pools["device"]), SPEC),
                         "offload": MSAOffloadTorchBackend(runner(self.pools["offload"]), SPEC)}

    def step(self, mode: str, reqs: list[int], new_tokens: int) -> None:
        """Grow ``reqs`` by ``new_tokens`` each, run every sparse layer through both, compare."""
        for req in reqs:
            self.paged.grow(req, new_tokens)
        lens = [self.paged.lens[r] for r in reqs]
        batch = forward_batch_for(mode, self.paged.req_to_token, torch.tensor(reqs), lens, [new_tokens] * len(reqs))
        rows = new_tokens * len(reqs)
        for layer_id in SPARSE:
            q, k, v = (torch.randn(rows, HQ if i == 0 else HKV, D, generator=self.generator) for i in range(3))
            iq, ik = torch.randn(rows, HKV, DI, generator=self.generator), torch.randn(rows, DI, generator=self.generator)
            out = {}
            for name, backend in self.backends.items():
                backend.init_forward_metadata(batch)
                forward = backend.forward_extend if mode == "EXTEND" else backend.forward_decode
                out[name] = forward(q.view(rows, -1), k.clone(), v.clone(), layer(layer_id), batch, index_q=iq, index_k=ik)
            assert torch.equal(out["device"], out["offload"]), f"layer {layer_id}, {mode} of requests {reqs}"

    def finish_and_hand_pages_to_a_new_request(self, req: int) -> list[int]:
        """End ``req``: its pages go back to the allocator, first out, and its row starts a new request."""
        paged = self.paged
        pages = (paged.req_to_token[req, : paged.lens[req] : BLOCK] // BLOCK).tolist()
        paged.free.extend(reversed(pages))  # the allocator pops from the end: the new request's block b gets page b
        paged.req_to_token[req].zero_()
        paged.lens[req] = 0
        return pages


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("fp8_index_keys", [False, True], ids=["model-dtype-keys", "fp8-keys"])
def test_a_new_request_on_resident_pages_of_a_finished_one_answers_as_on_the_device(fp8_index_keys, kv_dtype):
    twins = Twins(fp8_index_keys, kv_dtype, torch.Generator().manual_seed(3))
    for req in range(3):
        twins.step("EXTEND", [req], 33)
    for _ in range(5):
        twins.step("DECODE", [0, 1, 2], 1)
    twins.step("DECODE", [0], 1)  # request 0's selection is what the caches hold now

    pages = twins.finish_and_hand_pages_to_a_new_request(0)
    resident = [p for p in pages if int(twins.pools["offload"].block_cache(SPARSE[0]).page_entry[p]) >= 0]
    assert resident, "no reused page is resident: the check would prove nothing"
    twins.step("EXTEND", [0], 13)  # chunks ending mid-block, on the reused pages
    twins.step("EXTEND", [0], 10)
    for _ in range(8):
        twins.step("DECODE", [0, 1, 2], 1)
