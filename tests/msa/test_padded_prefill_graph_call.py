"""The MSA backend under SGLang's breakable prefill CUDA graphs.

A graphed extend batch is padded to the captured token count; attention runs eagerly between the
graph's segments on the real tokens only (``RadixAttention``'s eager path): q, k, v and
``out_cache_loc`` arrive narrowed, keyword operands SGLang does not know (M3's ``index_q`` /
``index_k``) at the padded length. The backend narrows those itself: the same output and cache as
an unpadded call, and nothing written for the padding.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
from forward_batch_doubles import forward_batch_for

from sglang_m3.msa.backend import MSATorchBackend


class _SlotPool:
    """SGLang's pool surface over slot-indexed caches ``{"k", "v", "index_k"}`` (one layer)."""

    def __init__(self, caches: dict[str, torch.Tensor]):
        self.caches = caches

    def _write(self, name, loc, values):
        self.caches[name][loc] = values.reshape(self.caches[name][loc].shape)

    def set_kv_buffer(self, layer, write, k, v):
        self._write("k", write.loc, k)
        self._write("v", write.loc, v)

    def set_index_k(self, layer_id, loc, index_k):
        self._write("index_k", loc, index_k)

    def get_key_buffer(self, layer_id):
        return self.caches["k"]

    def get_value_buffer(self, layer_id):
        return self.caches["v"]

    def get_index_k_buffer(self, layer_id):
        return self.caches["index_k"]


def test_padded_index_operands_are_narrowed_to_the_real_tokens():
    gen = torch.Generator().manual_seed(0)
    hkv, hq, d, pad = 1, 2, 8, 3
    kv_lens, query_lens = [40, 23], [17, 23]
    slots = sum(kv_lens) + 4
    req_to_token = torch.zeros(3, 64, dtype=torch.int64)
    order = (torch.randperm(slots - 1, generator=gen) + 1).tolist()
    req_to_token[0, :40], req_to_token[1, :23] = torch.tensor(order[:40]), torch.tensor(order[40:63])
    pool_indices = torch.tensor([0, 1])
    fb = forward_batch_for("EXTEND", req_to_token, pool_indices, kv_lens, query_lens)
    n = sum(query_lens)
    k_all, v_all, ik_all = (torch.randn(slots, *shape, generator=gen, dtype=torch.float64) for shape in ((hkv, d), (hkv, d), (d,)))
    q = torch.randn(n, hq * d, generator=gen, dtype=torch.float64)
    index_q = torch.randn(n + pad, hkv, d, generator=gen, dtype=torch.float64)
    index_k = torch.cat([ik_all[fb.out_cache_loc], torch.full((pad, d), float("nan"), dtype=torch.float64)])
    spec = SimpleNamespace(index_block_size=8, index_topk_blocks=2, index_local_blocks=1, index_init_blocks=1)
    layer = SimpleNamespace(layer_id=0, tp_q_head_num=hq, qk_head_dim=d, v_head_dim=d, scaling=1 / math.sqrt(d), k_scale=None, v_scale=None)

    outputs, caches = [], []
    for padded in (False, True):
        k_cache, v_cache, ik_cache = k_all.clone(), v_all.clone(), ik_all.clone()
        ik_cache[fb.out_cache_loc] = float("nan")
        runner = SimpleNamespace(
            req_to_token_pool=SimpleNamespace(req_to_token=req_to_token),
            token_to_kv_pool=_SlotPool({"k": k_cache, "v": v_cache, "index_k": ik_cache}),
        )
        backend = MSATorchBackend(runner, spec)
        backend.init_forward_metadata(fb)
        k, v = k_all[fb.out_cache_loc].view(n, -1), v_all[fb.out_cache_loc].view(n, -1)
        iq, ik = (index_q, index_k) if padded else (index_q[:n], index_k[:n])
        outputs.append(backend.forward_extend(q, k, v, layer, fb, index_q=iq, index_k=ik))
        caches.append(ik_cache)
    assert outputs[1].shape == (n, hq * d)
    torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=0)
    torch.testing.assert_close(caches[1], ik_all, rtol=0, atol=0)
