"""fp8 main KV caches (SGLang's ``--kv-cache-dtype fp8_e4m3``) in the MSA Triton kernels, under the
Triton interpreter, against the torch reference reading the same fp8 caches.

The pool stores ``k / k_scale`` and ``v / v_scale`` in fp8 (one scale per layer; 1.0 without
checkpoint scales). The kernels widen each loaded tile to the query dtype, fold ``k_scale`` into the
score scale and apply ``v_scale`` to the output; the reference multiplies the widened keys and
values. Both read the same fp8 bytes, so they agree to float32 summation order (the interpreter
handles fp8 loads and casts on the CPU). Scales that are not powers of two make a misplaced or
missing scale visible.
"""

import pytest
import torch

from msa_kernels.paged_batch import compare_with_reference, make_paged_batch
from msa_kernels.plan import page_table_from_req_to_token, plan_decode, plan_prefill
from msa_kernels.reference import MSAParams

BLOCK = 16
PARAMS = MSAParams(block_size=BLOCK, topk=4, local_blocks=1, init_blocks=0)
K_SCALE, V_SCALE = 0.37, 1.9


def _fp8_kv_batch(seq_lens, extend_lens, seed, decode_q_len=0, max_context=None, dtype=torch.float8_e4m3fn):
    gen = torch.Generator().manual_seed(seed)
    batch = make_paged_batch(
        seq_lens, extend_lens, 4, 2, head_dim=32, index_dim=32, block_size=BLOCK, dtype=torch.float32, device="cpu",
        decode_q_len=decode_q_len, max_context=max_context, generator=gen,
    )
    return batch.with_fp8_kv(K_SCALE, V_SCALE, dtype)


def _table(batch, max_context):
    return page_table_from_req_to_token(batch.req_to_token, torch.arange(len(batch.seq_lens)), max_context, BLOCK)


def _scales(batch):
    return {"k_scale": batch.k_scale, "v_scale": batch.v_scale}


@pytest.mark.parametrize("block_major", [False, True])
def test_prefill_reads_fp8_kv_like_the_reference(interpreted_api, block_major):
    """Fresh prefill and chunks after prefixes of 80 and 28 tokens; query-major and block-major attention."""
    seq_lens, extend_lens = [70, 130, 33], [70, 50, 5]
    batch = _fp8_kv_batch(seq_lens, extend_lens, seed=21)
    assert batch.k_cache.dtype == torch.float8_e4m3fn and batch.v_cache.dtype == torch.float8_e4m3fn
    plan = plan_prefill(
        PARAMS, _table(batch, max(seq_lens)), seq_lens, extend_lens, num_index_heads=2, index_rows=16,
        block_major=block_major, block_major_chunk=37,
    )
    out, selected = interpreted_api.run_prefill(plan, batch.q, batch.k_cache, batch.v_cache, batch.iq, batch.ik_cache, **_scales(batch))
    agreement = compare_with_reference(batch, PARAMS, out, selected, rel_tol=1e-4)
    assert agreement.ok, agreement.failures
    assert agreement.rows == sum(extend_lens) * 2


@pytest.mark.parametrize("q_len, dtype", [(1, torch.float8_e4m3fn), (3, torch.float8_e4m3fn), (1, torch.float8_e5m2)])
def test_decode_reads_fp8_kv_like_the_reference(interpreted_api, q_len, dtype):
    """Split attention with the in-kernel merge, per token at q_len 1 and 3; e5m2 too."""
    seq_lens = [40, 150, 17, 129]
    batch = _fp8_kv_batch(seq_lens, [q_len] * 4, seed=22 + q_len, decode_q_len=q_len, max_context=160, dtype=dtype)
    plan = plan_decode(PARAMS, _table(batch, 160), torch.tensor(seq_lens), q_len=q_len, num_kv_heads=2, num_sms=24)
    assert plan.attn_splits > 1
    out, selected = interpreted_api.run_decode(plan, batch.q, batch.k_cache, batch.v_cache, batch.iq, batch.ik_cache, **_scales(batch))
    agreement = compare_with_reference(batch, PARAMS, out, selected, rel_tol=1e-4)
    assert agreement.ok, agreement.failures
    assert agreement.rows == len(seq_lens) * q_len * 2


def test_scales_are_applied_not_ignored(interpreted_api):
    """The same fp8 bytes read with scale 1.0 give another output: the scales reach the kernel."""
    seq_lens = [40, 150]
    batch = _fp8_kv_batch(seq_lens, [1, 1], seed=5, decode_q_len=1, max_context=160)
    plan = plan_decode(PARAMS, _table(batch, 160), torch.tensor(seq_lens), num_kv_heads=2, num_sms=8)
    scaled, _ = interpreted_api.run_decode(plan, batch.q, batch.k_cache, batch.v_cache, batch.iq, batch.ik_cache, **_scales(batch))
    plain, _ = interpreted_api.run_decode(plan, batch.q, batch.k_cache, batch.v_cache, batch.iq, batch.ik_cache)
    assert (scaled - plain).abs().max() > 0.1


def test_cache_dtypes_and_scales_are_checked_by_name(interpreted_api):
    batch = _fp8_kv_batch([40], [1], seed=3, decode_q_len=1, max_context=48)
    plan = plan_decode(PARAMS, _table(batch, 48), torch.tensor([40]), num_kv_heads=2, num_sms=8)
    with pytest.raises(ValueError, match="v_cache must hold q's dtype"):
        interpreted_api.run_decode(plan, batch.q, batch.k_cache, batch.v_cache.to(torch.float16), batch.iq, batch.ik_cache)
    with pytest.raises(ValueError, match="k_scale = 0.5 is for an fp8 KV cache"):
        interpreted_api.run_decode(plan, batch.q, batch.k_cache.float(), batch.v_cache, batch.iq, batch.ik_cache, k_scale=0.5)
    with pytest.raises(ValueError, match="v_scale must be a positive finite float"):
        interpreted_api.run_decode(plan, batch.q, batch.k_cache, batch.v_cache, batch.iq, batch.ik_cache, v_scale=0.0)
