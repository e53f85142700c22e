"""fp8 (e4m3) index keys: the quantizer's format, the Triton cache insert that writes it, and the
index kernels that read it, under the Triton interpreter against the torch reference.

The kernels must choose the blocks the reference chooses from the *dequantized* keys (the fp8
semantics), compared exactly as the bf16 kernels are (sets, swaps only at near-ties).
"""

from dataclasses import replace

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st

from fp8_batches import fp8_batch, page_table
from msa_kernels import triton_index_quant  # reloaded in interpreter mode by ``interpreted_api``
from msa_kernels.paged_batch import compare_with_reference, reference_request
from msa_kernels.plan import plan_decode, plan_prefill
from msa_kernels.reference import MSAParams, dequantize_index_keys, quantize_index_keys

BLOCK = 16
PARAMS = MSAParams(block_size=BLOCK, topk=4, local_blocks=1, init_blocks=0)


@settings(max_examples=60, deadline=None)
@given(
    exponent=st.integers(-40, 40),
    seed=st.integers(0, 2**31 - 1),
    dim=st.sampled_from([1, 7, 32, 128]),
)
def test_quantize_round_trip_and_minimal_power_of_two_scale(exponent, seed, dim):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(5, dim, generator=gen) * 2.0**exponent
    keys, scale = quantize_index_keys(x)
    assert keys.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == (5,)
    mantissa, _ = torch.frexp(scale)
    assert torch.all(mantissa == 0.5)  # powers of two
    amax = x.abs().amax(-1)
    assert torch.all(amax <= 448 * scale) and torch.all(amax > 224 * scale)  # the smallest such power
    back = dequantize_index_keys(keys, scale)
    # e4m3 keeps 3 mantissa bits: half a step is 2**-4 relative; below 2**-6 (subnormal) a fixed 2**-10
    bound = torch.maximum(x.abs() * 2.0**-4, scale[:, None] * 2.0**-10)
    assert torch.all((back - x).abs() <= bound)


def _reference_rows(x: torch.Tensor):
    keys, scale = quantize_index_keys(x)
    return keys.float(), scale


def _special_rows(dim: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    rows = [
        torch.randn(dim, generator=gen),
        torch.zeros(dim),
        torch.full((dim,), 448.0 * 2.0**-3),  # amax exactly on a power-of-two boundary
        torch.randn(dim, generator=gen) * 1e-30,
        torch.linspace(-1, 1, dim) * torch.logspace(-7, 0, dim),  # spans e4m3's subnormals after scaling
        torch.randn(dim, generator=gen) * 3.0e4,
    ]
    # values exactly half-way between two e4m3 neighbours (round to even) at scale 1
    halfway = torch.tensor([448.0, 1.0 + 1 / 16, 1.0 + 3 / 16, 0.015625 * (1 + 1 / 16), 3 * 2.0**-10, -(2.0 + 1 / 8)])
    rows.append(torch.cat([halfway, torch.zeros(dim - halfway.numel())]))
    return torch.stack(rows)


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
def test_cache_insert_writes_the_reference_fp8_bytes(interpreted_api, src_dtype):
    """The one-launch K/V/index insert quantizes exactly like ``quantize_index_keys`` (values and scales)."""
    from msa_kernels import triton_cache_insert, triton_index_quant
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(triton_cache_insert.cache_insert_kernel, InterpretedFunction):
        import importlib

        importlib.reload(triton_index_quant)
        importlib.reload(triton_cache_insert)
    dim = 32
    index_k = _special_rows(dim).to(src_dtype)
    tokens = index_k.shape[0]
    loc = torch.tensor([9, 2, 5, 11, 0, 7, 3])[:tokens]
    k = torch.randn(tokens, 2, 8)
    v = torch.randn(tokens, 2, 8)
    k_buffer, v_buffer = torch.zeros(12, 2, 8), torch.zeros(12, 2, 8)
    ik_buffer = torch.zeros(12, dim, dtype=torch.float8_e4m3fn)
    scale_buffer = torch.full((12,), -1.0)
    triton_cache_insert.insert_kv_and_index(loc, k, v, index_k, k_buffer, v_buffer, ik_buffer, scale_buffer)
    want_keys, want_scale = _reference_rows(index_k)
    assert torch.equal(ik_buffer[loc].float(), want_keys)
    assert torch.equal(scale_buffer[loc], want_scale)
    assert torch.equal(k_buffer[loc], k) and torch.equal(v_buffer[loc], v)
    untouched = torch.ones(12, dtype=torch.bool)
    untouched[loc] = False
    assert torch.all(scale_buffer[untouched] == -1.0)


def test_cache_insert_refuses_fp8_keys_without_scales(interpreted_api):
    from msa_kernels.triton_cache_insert import insert_kv_and_index

    k = torch.zeros(1, 1, 4)
    fp8 = torch.zeros(4, 8, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="index_k_scale_buffer"):
        insert_kv_and_index(torch.tensor([0]), k, k, torch.zeros(1, 8), torch.zeros(4, 1, 4), torch.zeros(4, 1, 4), fp8)
    with pytest.raises(ValueError, match="index_k_scale_buffer must be float32"):
        insert_kv_and_index(
            torch.tensor([0]), k, k, torch.zeros(1, 8), torch.zeros(4, 1, 4), torch.zeros(4, 1, 4), fp8, torch.zeros(3)
        )


def _fp8_batch(seq_lens, extend_lens, seed, decode_q_len=0, max_context=None):
    return fp8_batch(seq_lens, extend_lens, seed, hq=4, hkv=2, dim=32, block=BLOCK, dtype=torch.float32, device="cpu",
                     decode_q_len=decode_q_len, max_context=max_context)


def _table(batch, max_context):
    return page_table(batch, max_context, BLOCK)


@pytest.mark.parametrize("index_splits", [1, 3])
def test_prefill_selection_with_fp8_keys_matches_reference(interpreted_api, index_splits):
    """Fresh prefill and chunks after prefixes of 80 and 117 tokens; single-pass and split index scans.

    Selection only: the prefill attention never reads index keys (the decode test runs the whole step).
    """
    seq_lens, extend_lens = [70, 130, 150], [70, 50, 33]
    batch = _fp8_batch(seq_lens, extend_lens, seed=index_splits)
    plan = plan_prefill(PARAMS, _table(batch, max(seq_lens)), seq_lens, extend_lens, num_index_heads=2, index_splits=index_splits)
    selected = interpreted_api.prefill_select(plan, batch.iq, batch.ik_cache, batch.ik_scale)
    # the reference's own outputs stand in for the attention, so only the selections are compared
    reference_out = torch.cat([reference_request(batch, b, PARAMS)[0] for b in range(len(seq_lens))])
    agreement = compare_with_reference(batch, PARAMS, reference_out, selected, rel_tol=0.0)
    assert agreement.ok, agreement.failures
    assert agreement.rows == sum(extend_lens) * 2


def test_decode_with_fp8_keys_matches_reference(interpreted_api):
    seq_lens = [40, 150, 17, 129]
    batch = _fp8_batch(seq_lens, [2] * 4, seed=7, decode_q_len=2, max_context=160)
    plan = plan_decode(PARAMS, _table(batch, 160), torch.tensor(seq_lens), q_len=2, num_kv_heads=2, num_sms=8)
    out, selected = interpreted_api.run_decode(
        plan, batch.q, batch.k_cache, batch.v_cache, batch.iq, batch.ik_cache, ik_scale=batch.ik_scale
    )
    agreement = compare_with_reference(batch, PARAMS, out, selected, rel_tol=1e-4)
    assert agreement.ok, agreement.failures
    assert agreement.rows == 8 * 2


@settings(max_examples=25, deadline=None)
@given(exponent=st.integers(-30, 30), seed=st.integers(0, 2**31 - 1))
def test_a_bf16_query_splits_into_two_fp8_terms_exactly(interpreted_api, exponent, seed):
    """``split_e4m3``: ``(hi + lo / 16) * scale`` gives back every bf16 value the scan's fp8 MMAs
    need, per column of its own magnitude, down to 2**-14 of the column's largest |value|; the
    scale comes from both halves of the column and each half splits on its own, as in the scan."""

    @triton.jit
    def split_kernel(q_ptr, hi_ptr, lo_ptr, scale_ptr, D: tl.constexpr, ROWS: tl.constexpr):
        half = tl.arange(0, D // 2)[:, None] * ROWS + tl.arange(0, ROWS)[None, :]
        q0 = tl.load(q_ptr + half).to(tl.float32)
        q1 = tl.load(q_ptr + (D // 2) * ROWS + half).to(tl.float32)
        scale, inverse = triton_index_quant.e4m3_column_scales(q0, q1)
        hi, lo = triton_index_quant.split_e4m3(q0, inverse)
        tl.store(hi_ptr + half, hi)
        tl.store(lo_ptr + half, lo)
        hi, lo = triton_index_quant.split_e4m3(q1, inverse)
        tl.store(hi_ptr + (D // 2) * ROWS + half, hi)
        tl.store(lo_ptr + (D // 2) * ROWS + half, lo)
        tl.store(scale_ptr + tl.arange(0, ROWS), scale)

    gen = torch.Generator().manual_seed(seed)
    magnitudes = 2.0 ** (exponent + torch.randint(-3, 4, (1, 16), generator=gen).float())  # columns of their own scale
    q = (torch.randn(32, 16, generator=gen) * magnitudes).bfloat16()
    q[0, 0] = 0.0
    hi = torch.empty(32, 16, dtype=torch.float8_e4m3fn)
    lo = torch.empty_like(hi)
    scale = torch.empty(16)
    split_kernel[(1,)](q, hi, lo, scale, D=32, ROWS=16)
    back = (hi.float() + lo.float() / 16) * scale
    representable = q.float().abs() >= q.float().abs().amax(0) * 2.0**-14
    assert torch.equal(back[representable], q.float()[representable])
    assert ((back - q.float()).abs() <= q.float().abs().amax(0) * 2.0**-20).all()


def test_decode_selection_with_fp8_keys_and_a_bf16_query(interpreted_api):
    """The scan's fp8-MMA form (bf16 queries) chooses the reference's blocks over the dequantized keys."""
    seq_lens = [40, 150, 17, 129]
    batch = _fp8_batch(seq_lens, [1] * 4, seed=11, decode_q_len=1, max_context=160)
    batch = replace(batch, iq=batch.iq.bfloat16().float())  # the reference scores the query the kernel reads
    plan = plan_decode(PARAMS, _table(batch, 160), torch.tensor(seq_lens), q_len=1, num_kv_heads=2, num_sms=8)
    selected = interpreted_api.decode_select(plan, batch.iq.bfloat16(), batch.ik_cache, batch.ik_scale)
    # the reference's own outputs stand in for the attention, so only the selections are compared
    reference_out = torch.cat([reference_request(batch, b, PARAMS)[0] for b in range(len(seq_lens))])
    agreement = compare_with_reference(batch, PARAMS, reference_out, selected, rel_tol=0.0)
    assert agreement.ok, agreement.failures
    assert agreement.rows == 4 * 2


def test_scales_are_required_exactly_with_fp8_keys(interpreted_api):
    batch = _fp8_batch([40], [1], seed=1, decode_q_len=1)
    plan = plan_decode(PARAMS, _table(batch, 40), torch.tensor([40]), num_kv_heads=2, num_sms=8)
    with pytest.raises(ValueError, match="pass their per-slot scales as ik_scale"):
        interpreted_api.run_decode(plan, batch.q, batch.k_cache, batch.v_cache, batch.iq, batch.ik_cache)
    with pytest.raises(ValueError, match="ik_scale is for float8_e4m3fn index keys"):
        interpreted_api.decode_select(plan, batch.iq, batch.ik_cache.float(), batch.ik_scale)
    with pytest.raises(ValueError, match="ik_scale must be contiguous float32"):
        interpreted_api.decode_select(plan, batch.iq, batch.ik_cache, batch.ik_scale.double())
