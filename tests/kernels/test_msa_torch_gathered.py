"""The CPU serving path's sparse attention over the gathered blocks and its block scores by row
blocks (``msa_kernels.torch_gathered``) against the reference's definitions over every key.

Random requests (hypothesis): lengths with a partial last block, queries anywhere in them (a
chunk after a prefix, a lone decode token), GQA groups, the reference's own block selection and
random selections with -1 padding, fp32 / bf16 / fp64 inputs and fp8-cache scales, row counts
beyond one row block. The same terms are summed in another order, so fp64 agrees to 1e-12 and
fp32 to float rounding; bf16 outputs to one rounding step.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from msa_kernels import torch_gathered
from msa_kernels.reference import MSAParams, block_scores, select_blocks, sparse_attention
from msa_kernels.torch_gathered import sparse_attention_gathered

TOLERANCE = {torch.float64: (1e-12, 1e-12), torch.float32: (1e-5, 1e-5), torch.bfloat16: (2**-8, 1e-5)}


def _request(seed: int, length: int, n: int, hkv: int, group: int, d: int, dtype):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, hkv * group, d, generator=gen, dtype=torch.float64).to(dtype)
    k, v = (torch.randn(length, hkv, d, generator=gen, dtype=torch.float64).to(dtype) for _ in range(2))
    q_pos = torch.sort(torch.randint(0, length, (n,), generator=gen)).values
    q_pos[-1] = length - 1
    return gen, q, k, v, q_pos


def _random_selection(gen, q_pos, hkv: int, block_size: int, topk: int) -> torch.Tensor:
    """Any ascending choice of visible blocks that keeps each query's own block, -1 padded."""
    rows = []
    for p in q_pos.tolist():
        own = p // block_size
        heads = []
        for _ in range(hkv):
            others = torch.randperm(own, generator=gen)[: int(torch.randint(0, topk, (1,), generator=gen))].tolist() if own else []
            chosen = sorted({own, *others})
            heads.append(chosen + [-1] * (topk - len(chosen)))
        rows.append(heads)
    return torch.tensor(rows, dtype=torch.long)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    length=st.integers(1, 300),
    n=st.integers(1, 40),
    hkv=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 3]),
    block_size=st.sampled_from([4, 16]),
    topk=st.integers(1, 6),
    dtype=st.sampled_from([torch.float64, torch.float32, torch.bfloat16]),
    reference_selection=st.booleans(),
)
def test_equals_the_reference(seed, length, n, hkv, group, block_size, topk, dtype, reference_selection):
    gen, q, k, v, q_pos = _request(seed, length, n, hkv, group, 8, dtype)
    if reference_selection:
        iq = torch.randn(n, hkv, 4, generator=gen, dtype=torch.float64).to(dtype)
        ik = torch.randn(length, 4, generator=gen, dtype=torch.float64).to(dtype)
        selected = select_blocks(block_scores(iq, ik, q_pos, block_size), q_pos, MSAParams(block_size, topk))
    else:
        selected = _random_selection(gen, q_pos, hkv, block_size, topk)
    want = sparse_attention(q, k, v, selected, q_pos, block_size)
    got = sparse_attention_gathered(q, k, v, selected, q_pos, block_size)
    rtol, atol = TOLERANCE[dtype]
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


def test_rows_beyond_one_row_block_and_fp8_cache_scales(monkeypatch):
    monkeypatch.setattr(torch_gathered, "ROW_BLOCK", 7)
    gen, q, k, v, q_pos = _request(3, 150, 30, 2, 2, 8, torch.float32)
    k8, v8 = (k / 2).to(torch.float8_e4m3fn), (v / 4).to(torch.float8_e4m3fn)
    iq, ik = torch.randn(30, 2, 4, generator=gen), torch.randn(150, 4, generator=gen)
    selected = select_blocks(block_scores(iq, ik, q_pos, 16), q_pos, MSAParams(16, 3))
    want = sparse_attention(q, k8, v8, selected, q_pos, 16, 0.3, k_scale=2.0, v_scale=4.0)
    got = sparse_attention_gathered(q, k8, v8, selected, q_pos, 16, 0.3, k_scale=2.0, v_scale=4.0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_no_queries():
    q, k = torch.zeros(0, 2, 8), torch.zeros(5, 1, 8)
    assert sparse_attention_gathered(q, k, k, torch.zeros(0, 1, 2, dtype=torch.long), torch.zeros(0, dtype=torch.long), 4).shape == (0, 2, 8)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    length=st.integers(1, 300),
    n=st.integers(0, 40),
    hkv=st.sampled_from([1, 2]),
    block_size=st.sampled_from([4, 16]),
    row_block=st.sampled_from([1, 5, 256]),
    sorted_positions=st.booleans(),
    dtype=st.sampled_from([torch.float64, torch.float32, torch.bfloat16]),
)
def test_block_scores_by_rows_equal_the_reference(seed, length, n, hkv, block_size, row_block, sorted_positions, dtype):
    """Queries in any order (a chunk after a prefix is sorted; a batch need not be) and row blocks
    of 1 to all rows: the same scores (fp64 to 1e-12, fp32 accumulation to 1e-5), -inf exactly
    where the reference has it, and in fp64 the same choice."""
    gen = torch.Generator().manual_seed(seed)
    iq = torch.randn(n, hkv, 8, generator=gen, dtype=torch.float64).to(dtype)
    ik = torch.randn(length, 8, generator=gen, dtype=torch.float64).to(dtype)
    q_pos = torch.randint(0, length, (n,), generator=gen)
    if sorted_positions:
        q_pos = torch.sort(q_pos).values
    want = block_scores(iq, ik, q_pos, block_size)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch_gathered, "ROW_BLOCK", row_block)
        got = torch_gathered.block_scores_by_rows(iq, ik, q_pos, block_size)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    tolerance = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
    if dtype == torch.float64 and n:
        params = MSAParams(block_size, 3)
        assert torch.equal(select_blocks(got, q_pos, params), select_blocks(want, q_pos, params))


def test_block_scores_by_rows_of_fp8_index_keys():
    from msa_kernels.reference import quantize_index_keys

    gen = torch.Generator().manual_seed(5)
    iq, ik = torch.randn(30, 2, 8, generator=gen), torch.randn(150, 8, generator=gen)
    ik8, scales = quantize_index_keys(ik)
    q_pos = torch.arange(120, 150)
    torch.testing.assert_close(torch_gathered.block_scores_by_rows(iq, ik8, q_pos, 16, scales.reshape(-1)),
                               block_scores(iq, ik8, q_pos, 16, scales.reshape(-1)), rtol=1e-6, atol=1e-6)
