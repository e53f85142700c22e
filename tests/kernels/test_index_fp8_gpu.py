"""fp8 index keys on a CUDA GPU at M3 shapes (bf16 queries, e4m3 keys + per-token scales) vs the
torch reference on the dequantized keys; the cache insert's quantized bytes vs the torch quantizer.
Skipped without CUDA (the interpreter versions are in test_index_fp8.py)."""

import pytest
import torch

from fp8_batches import fp8_batch, page_table
from msa_kernels.paged_batch import compare_with_reference
from msa_kernels.plan import plan_decode, plan_prefill
from msa_kernels.reference import MSAParams, quantize_index_keys

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

BLOCK = 128
PARAMS = MSAParams(block_size=BLOCK, topk=16, local_blocks=1, init_blocks=0)


def _fp8_batch(seq_lens, extend_lens, seed, decode_q_len=0, max_context=None):
    return fp8_batch(seq_lens, extend_lens, seed, hq=64, hkv=4, dim=128, block=BLOCK, dtype=torch.bfloat16, device="cuda",
                     decode_q_len=decode_q_len, max_context=max_context)


def _table(batch, max_context):
    return page_table(batch, max_context, BLOCK)


def _assert_agrees(agreement):
    assert agreement.ok, agreement.failures
    assert agreement.tie_swaps <= max(2, agreement.rows // 200)


@pytest.mark.parametrize("index_splits", [None, 1])
def test_prefill_fp8(index_splits):
    from msa_kernels.api import run_prefill

    seq_lens, extend_lens = [3000, 9000, 130], [3000, 500, 1]
    batch = _fp8_batch(seq_lens, extend_lens, seed=3)
    plan = plan_prefill(PARAMS, _table(batch, max(seq_lens)), seq_lens, extend_lens, num_index_heads=4, index_splits=index_splits)
    out, selected = run_prefill(plan, batch.q, batch.k_cache, batch.v_cache, batch.iq, batch.ik_cache, ik_scale=batch.ik_scale)
    _assert_agrees(compare_with_reference(batch, PARAMS, out, selected, rel_tol=2e-2))


@pytest.mark.parametrize("q_len", [1, 4])
def test_decode_fp8_in_a_cuda_graph(q_len):
    from msa_kernels.api import run_decode

    seq_lens = [300, 2049, 20000, 70000]
    batch = _fp8_batch(seq_lens, [q_len] * 4, seed=q_len, decode_q_len=q_len, max_context=72 * 1024)
    plan = plan_decode(PARAMS, _table(batch, 72 * 1024), torch.tensor(seq_lens, device="cuda"), q_len=q_len, num_kv_heads=4)
    args = (plan, batch.q, batch.k_cache, batch.v_cache, batch.iq, batch.ik_cache)
    run_decode(*args, ik_scale=batch.ik_scale)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, selected = run_decode(*args, ik_scale=batch.ik_scale)
    graph.replay()
    torch.cuda.synchronize()
    _assert_agrees(compare_with_reference(batch, PARAMS, out, selected, rel_tol=2e-2))


def test_cache_insert_quantizes_like_the_reference():
    from msa_kernels.triton_cache_insert import insert_kv_and_index

    gen = torch.Generator().manual_seed(0)
    tokens, slots = 300, 1024
    index_k = (torch.randn(tokens, 128, generator=gen) * torch.logspace(-4, 3, tokens)[:, None]).to(torch.bfloat16).cuda()
    k = torch.randn(tokens, 4, 128, generator=gen).to(torch.bfloat16).cuda()
    loc = torch.randperm(slots, generator=gen)[:tokens].cuda()
    k_buffer = torch.zeros(slots, 4, 128, dtype=torch.bfloat16, device="cuda")
    v_buffer = torch.zeros_like(k_buffer)
    ik_buffer = torch.zeros(slots, 128, dtype=torch.float8_e4m3fn, device="cuda")
    scales = torch.zeros(slots, dtype=torch.float32, device="cuda")
    insert_kv_and_index(loc, k, k, index_k, k_buffer, v_buffer, ik_buffer, scales)
    want_keys, want_scales = quantize_index_keys(index_k)
    assert torch.equal(ik_buffer[loc].float(), want_keys.float())
    assert torch.equal(scales[loc], want_scales)
