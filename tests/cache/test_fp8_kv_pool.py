"""An fp8 main KV cache (``--kv-cache-dtype fp8_e4m3``) in the project's pool and the torch MSA path (CPU).

What the pool stores (fp8 K/V, index keys in their own dtype), what SGLang's pool sizing is told
(the same bytes), and that a sparse layer stores and reads K/V the SGLang way: ``k / k_scale`` in
fp8, read back times the scale (1.0 without checkpoint scales).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from forward_batch_doubles import forward_batch_for
from msa_kernels.reference import MSAParams, msa_attention

from sglang_m3.cache.index_kv_pool import M3IndexedKVPool, index_bytes_per_token, indexed_pool_class
from sglang_m3.msa.backend import MSATorchBackend, stored_kv_scales
from sglang_m3.recipe.model_geometry import M3
from sglang_m3.recipe.render import INDEX_KEY_DTYPE_ENV

LAYERS, SPARSE, HQ, HKV, D, DI, PAGE, SIZE = 4, (1, 2, 3), 4, 2, 8, 8, 4, 64
FP8 = torch.float8_e4m3fn


def _pool(model_dtype, index_key_fp8=False, kv_dtype=FP8):
    attrs = {"sparse_layer_ids": SPARSE, "index_head_dim": DI, "index_key_fp8": index_key_fp8, "model_dtype": model_dtype}
    pool_class = type("Pool", (M3IndexedKVPool,), attrs)
    return pool_class(size=SIZE, page_size=PAGE, dtype=kv_dtype, head_num=HKV, head_dim=D, layer_num=LAYERS,
                      device="cpu", enable_memory_saver=False)


@pytest.mark.parametrize("model_dtype", [torch.bfloat16, torch.float32])
def test_pool_stores_fp8_kv_and_model_dtype_index_keys(model_dtype):
    pool = _pool(model_dtype)
    assert pool.get_key_buffer(1).dtype == FP8 and pool.get_value_buffer(1).dtype == FP8
    assert pool.k_buffer[0].element_size() == 1  # SGLang keeps the bytes as uint8 and views them as fp8
    assert pool.get_index_k_buffer(1).dtype == model_dtype and pool.get_index_k_scale_buffer(1) is None
    index_k = torch.randn(3, DI).to(model_dtype)
    pool.set_index_k(2, torch.tensor([4, 5, 6]), index_k)
    assert torch.equal(pool.get_index_k_buffer(2)[4:7], index_k)  # not rounded to fp8 or bf16


def test_opt_in_fp8_index_keys_still_apply_under_an_fp8_kv_cache():
    pool = _pool(torch.bfloat16, index_key_fp8=True)
    assert pool.get_index_k_buffer(1).dtype == FP8 and pool.get_index_k_scale_buffer(1).dtype == torch.float32


class RealSpec:
    sparse_layer_ids = tuple(i for i, is_sparse in enumerate(M3.layer_is_sparse) if is_sparse)
    index_head_dim = M3.index_key_dim


@pytest.mark.parametrize("model_dtype, element", [(torch.bfloat16, 2), (torch.float32, 4)])
def test_sizing_counts_the_index_keys_the_pool_allocates(monkeypatch, model_dtype, element):
    monkeypatch.delenv(INDEX_KEY_DTYPE_ENV, raising=False)
    assert indexed_pool_class(RealSpec, model_dtype).model_dtype == model_dtype
    assert index_bytes_per_token(RealSpec, 0, 60, FP8, model_dtype=model_dtype) == 57 * 128 * element
    pool = _pool(model_dtype)
    assert pool.index_k_size_bytes() == len(SPARSE) * (SIZE + PAGE) * DI * element
    # a 16-bit or fp32 KV cache keeps storing index keys in its own dtype
    assert index_bytes_per_token(RealSpec, 0, 60, torch.bfloat16, model_dtype=torch.float32) == 57 * 128 * 2


def _layer(layer_id, k_scale=None, v_scale=None):
    return SimpleNamespace(
        layer_id=layer_id, tp_q_head_num=HQ, tp_k_head_num=HKV, qk_head_dim=D, v_head_dim=D, scaling=D**-0.5,
        k_scale=None if k_scale is None else torch.tensor(k_scale), v_scale=None if v_scale is None else torch.tensor(v_scale),
        k_scale_float=k_scale, v_scale_float=v_scale,
    )


@pytest.mark.parametrize("scales", [(None, None), (0.37, 1.9)], ids=["no-checkpoint-scales", "checkpoint-scales"])
def test_torch_path_stores_scaled_fp8_and_reads_it_back_scaled(scales):
    """A 40-token prompt (10 blocks of 4, top-2: blocks compete) through MSATorchBackend on an fp8 pool."""
    pool = _pool(torch.float32)
    tokens, layer = 40, _layer(2, *scales)
    req_to_token = torch.zeros(2, 48, dtype=torch.int64)
    req_to_token[1, :tokens] = torch.randperm(SIZE, generator=torch.Generator().manual_seed(0))[:tokens] + PAGE
    runner = SimpleNamespace(req_to_token_pool=SimpleNamespace(req_to_token=req_to_token), token_to_kv_pool=pool)
    spec = SimpleNamespace(index_block_size=PAGE, index_topk_blocks=2, index_local_blocks=1, index_init_blocks=0)
    backend = MSATorchBackend(runner, spec)
    fb = forward_batch_for("EXTEND", req_to_token, torch.tensor([1]), [tokens], [tokens])
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(tokens, HQ if i == 0 else HKV, D, generator=gen) for i in range(3))
    iq, ik = torch.randn(tokens, HKV, DI, generator=gen), torch.randn(tokens, DI, generator=gen)
    k_in, v_in = k.clone(), v.clone()
    backend.init_forward_metadata(fb)
    out = backend.forward_extend(q.view(tokens, -1), k, v, layer, fb, index_q=iq, index_k=ik).view(tokens, HQ, D)

    k_scale, v_scale = (s or 1.0 for s in scales)
    slots = req_to_token[1, :tokens]
    assert torch.equal(pool.get_key_buffer(2)[slots].float(), (k_in / k_scale).to(FP8).float())
    assert torch.equal(pool.get_value_buffer(2)[slots].float(), (v_in / v_scale).to(FP8).float())
    assert torch.equal(k, k_in) and torch.equal(v, v_in)  # the model's tensors are not divided in place
    assert stored_kv_scales(layer, q, pool.get_key_buffer(2)) == (k_scale, v_scale)
    params = MSAParams(block_size=PAGE, topk=2)
    dequantized_k = pool.get_key_buffer(2)[slots].float() * k_scale
    dequantized_v = pool.get_value_buffer(2)[slots].float() * v_scale
    want, _ = msa_attention(q, dequantized_k, dequantized_v, iq, ik, torch.arange(tokens), params, D**-0.5)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    exact, _ = msa_attention(q, k_in, v_in, iq, ik, torch.arange(tokens), params, D**-0.5)
    assert 1e-3 < (out - exact).abs().max() < 0.2  # e4m3 rounding moved the output, by e4m3-sized steps


def test_a_cache_in_the_query_dtype_is_read_unscaled():
    layer = _layer(1, 0.5, 0.5)
    q = torch.zeros(1, HQ, D)
    assert stored_kv_scales(layer, q, torch.zeros(4, HKV, D)) == (1.0, 1.0)
    assert stored_kv_scales(_layer(1), q, torch.zeros(4, HKV, D, dtype=FP8)) == (1.0, 1.0)
