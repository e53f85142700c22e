"""The log-sum-exp merge kernel (``msa_kernels.triton_lse_merge``) under the Triton interpreter.

Two oracles: the torch ops it replaces (``merge_by_lse_reference``, what ``prefix_split_sdpa``
ran before it), which it must match but for what an ``exp`` one last bit apart moves (numpy's
here, torch's own on the CPU; on CUDA both are libdevice's); and attention over the union of the
two key sets computed at once in float64, which the merge of the two partial attentions must give
up to the rounding of its inputs and output. ``tests/gpu/test_dense_prefix_split_gpu.py`` runs it
compiled on CUDA, where it must equal the torch ops bit for bit.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from interpreter_only import INTERPRETER_ONLY

from msa_kernels.triton_lse_merge import merge_by_lse, merge_by_lse_reference

pytestmark = INTERPRETER_ONLY


def heads_first_partials(tokens, heads, dim, dtype, seed, lse_spread=3.0):
    """Two partial outputs and normalisers laid out as the attention ops return them transposed
    (``[1, heads, tokens, dim]`` and ``[1, heads, tokens]`` viewed token-major): strided views."""
    gen = torch.Generator().manual_seed(seed)
    outs = [torch.randn(1, heads, tokens, dim, generator=gen).to(dtype)[0].transpose(0, 1) for _ in range(2)]
    lses = [(torch.randn(1, heads, tokens, generator=gen) * lse_spread).reshape(heads, tokens).transpose(0, 1)[..., None] for _ in range(2)]
    return outs[0], lses[0], outs[1], lses[1]


def assert_equal_up_to_exp_rounding(got, want, a, lse_a, b, lse_b):
    """``got`` is the torch ops' ``want`` where their weights agree; an ``exp`` one fp32 ulp apart
    moves the fp32 sum by up to a few ulps of the terms' magnitude ``(|a| wa + |b| wb) / (wa + wb)``
    (more than of the result where the terms cancel), and the output's rounding then by at most one
    step of its dtype at that value."""
    pivot = torch.maximum(lse_a, lse_b).double()
    weight_a, weight_b = torch.exp(lse_a.double() - pivot), torch.exp(lse_b.double() - pivot)
    magnitude = (a.double().abs() * weight_a + b.double().abs() * weight_b) / (weight_a + weight_b)
    step = want.double().abs() * torch.finfo(want.dtype).eps + torch.finfo(want.dtype).smallest_normal
    bound = 8 * 2.0**-24 * magnitude + (0 if want.dtype == torch.float32 else step)
    assert ((got.double() - want.double()).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("tokens,heads,dim", [(1, 1, 128), (7, 64, 128), (33, 20, 96), (5, 3, 32), (2, 17, 8)])
def test_matches_the_torch_ops_up_to_an_exps_last_bit(dtype, tokens, heads, dim):
    """M3's 64 heads of 128 (TP1), heads past one block (20 > 16) or not a power of two, a dim that
    is not one (96), and the tiny model's 32."""
    a, lse_a, b, lse_b = heads_first_partials(tokens, heads, dim, dtype, seed=tokens * 100 + heads + dim)
    got = merge_by_lse(a, lse_a, b, lse_b)
    want = merge_by_lse_reference(a, lse_a, b, lse_b)
    assert got.shape == (tokens, heads, dim) and got.dtype == dtype and got.is_contiguous()
    assert_equal_up_to_exp_rounding(got, want, a, lse_a, b, lse_b)
    if dtype != torch.float32:  # a 16-bit result rarely sits where a last-bit change crosses a rounding boundary
        assert (got == want).float().mean() >= 0.99


def test_merging_two_partial_attentions_gives_attention_over_both_key_sets():
    """Against attention over the union computed at once in float64: the merge of the partial
    attentions (each rounded to bf16, as cuDNN returns them) is within the bf16 rounding of the
    partials and of the result."""
    gen = torch.Generator().manual_seed(7)
    tokens, heads, dim, keys_a, keys_b = 9, 4, 64, 50, 13
    q = torch.randn(tokens, heads, dim, generator=gen, dtype=torch.float64)
    k = torch.randn(keys_a + keys_b, heads, dim, generator=gen, dtype=torch.float64)
    v = torch.randn(keys_a + keys_b, heads, dim, generator=gen, dtype=torch.float64)
    scores = torch.einsum("thd,khd->htk", q, k) / math.sqrt(dim)

    def attend(part):
        logits = scores[:, :, part]
        out = torch.einsum("htk,khd->thd", torch.softmax(logits, dim=-1), v[part])
        return out.to(torch.bfloat16), torch.logsumexp(logits, dim=-1).transpose(0, 1)[..., None].float()

    union = torch.einsum("htk,khd->thd", torch.softmax(scores, dim=-1), v)
    merged = merge_by_lse(*attend(slice(0, keys_a)), *attend(slice(keys_a, None)))
    bound = 2 * 2.0**-8 * v.abs().max()  # the partials' bf16 rounding, then the result's
    assert (merged.double() - union).abs().max() <= bound


def test_an_empty_or_negligible_side_leaves_the_other_exactly():
    """A normaliser of -inf (no keys on that side) or one far below the other: the result is the
    other output itself; two -inf normalisers give NaN, as the torch ops do."""
    a, lse_a, b, lse_b = heads_first_partials(4, 8, 16, torch.bfloat16, seed=3)
    lse_b = lse_b.clone()
    lse_b[0], lse_b[1] = float("-inf"), lse_a[1] - 200.0
    got = merge_by_lse(a, lse_a, b, lse_b)
    torch.testing.assert_close(got[:2], a[:2], rtol=0, atol=0)
    lse_a = lse_a.clone()
    lse_a[2] = float("-inf")
    lse_b[2] = float("-inf")
    got = merge_by_lse(a, lse_a, b, lse_b)
    want = merge_by_lse_reference(a, lse_a, b, lse_b)
    assert got[2].isnan().all() and want[2].isnan().all()
    # equal normalisers weigh both sides alike (exp(0) is exact in any exp): the torch ops' mean exactly
    even = merge_by_lse(a, lse_b, b, lse_b)
    torch.testing.assert_close(even[3:], merge_by_lse_reference(a, lse_b, b, lse_b)[3:], rtol=0, atol=0)
    torch.testing.assert_close(even[3:], ((a[3:].float() + b[3:].float()) / 2).to(torch.bfloat16), rtol=0, atol=0)


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda a, la, b, lb: (a, la, b[:, :-1], lb), "one shape"),
        (lambda a, la, b, lb: (a, la, b.float(), lb), "dtype"),
        (lambda a, la, b, lb: (a.to(torch.float64), la, b.to(torch.float64), lb), "bf16, fp16 or fp32"),
        (lambda a, la, b, lb: (a, la.double(), b, lb), "lse_a must be fp32"),
        (lambda a, la, b, lb: (a, la, b, lb[..., 0]), "lse_b must be fp32"),
        (lambda a, la, b, lb: (a.transpose(1, 2).contiguous().transpose(1, 2), la, b, lb), "unit stride"),
    ],
)
def test_refuses_operands_it_would_read_wrongly(change, message):
    operands = change(*heads_first_partials(3, 4, 8, torch.bfloat16, seed=1))
    with pytest.raises(ValueError, match=message):
        merge_by_lse(*operands)


def test_no_tokens_gives_an_empty_result():
    a, lse_a, b, lse_b = heads_first_partials(0, 4, 8, torch.bfloat16, seed=1)
    assert merge_by_lse(a, lse_a, b, lse_b).shape == (0, 4, 8)


@settings(max_examples=40, deadline=None)
@given(
    tokens=st.integers(1, 6), heads=st.integers(1, 40), dim=st.integers(1, 160),
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    spread=st.sampled_from([0.0, 1.0, 30.0, 120.0]), seed=st.integers(0, 2**16),
)
def test_property_any_shape_and_normaliser_spread(tokens, heads, dim, dtype, spread, seed):
    """Any head count and width (masked tails), normalisers from equal to far apart (weights that
    underflow): the torch ops' result up to an exp's last bit."""
    a, lse_a, b, lse_b = heads_first_partials(tokens, heads, dim, dtype, seed=seed, lse_spread=spread)
    got = merge_by_lse(a, lse_a, b, lse_b)
    want = merge_by_lse_reference(a, lse_a, b, lse_b)
    assert_equal_up_to_exp_rounding(got, want, a, lse_a, b, lse_b)
