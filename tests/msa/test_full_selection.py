"""Extend requests whose queries select every visible block attend densely (``sglang_m3.msa.full_selection``).

The condition (``ceil(seq_len / block) <= topk``, prefix included) against the reference
selection at its boundaries, for M3's settings (block 128, top-16: 2,048 tokens) and the tiny
model's (block 16, top-4: 64 tokens) and with forced init/local blocks; the per-request plan of
extend batches with prefixes (radix hits, later chunks of a chunked prefill); and the attention
itself: dense causal SDPA equals the reference MSA whenever every block is selected (random
inputs, float64, GQA 16:1 and 8:1, fresh requests and chunks after a prefix, fp8 caches with
per-layer scales), while one token past the limit it does not.
"""

from __future__ import annotations

import math

import pytest
import torch
from forward_batch_doubles import forward_batch_for
from msa_kernels.reference import MSAParams, block_scores, msa_attention, select_blocks

from sglang_m3.msa.dense_prefill import causal_sdpa
from sglang_m3.msa.full_selection import (
    ENV,
    full_selection_dense_enabled,
    full_selection_limit,
    plan_full_selection,
    selects_every_block,
)

M3 = MSAParams(block_size=128, topk=16, local_blocks=1, init_blocks=0)
TINY = MSAParams(block_size=16, topk=4, local_blocks=1, init_blocks=0)
FORCED = MSAParams(block_size=8, topk=3, local_blocks=2, init_blocks=1)  # init + local blocks forced in
NO_LOCAL = MSAParams(block_size=16, topk=4, local_blocks=0, init_blocks=0)


def every_query_selects_every_visible_block(seq_len: int, params: MSAParams, seed: int = 0) -> bool:
    """From the reference: random index keys, every position 0 .. seq_len-1 queried, per index head."""
    gen = torch.Generator().manual_seed(seed)
    heads, dim = 2, 8
    iq = torch.randn(seq_len, heads, dim, generator=gen)
    ik = torch.randn(seq_len, dim, generator=gen)
    q_pos = torch.arange(seq_len)
    selected = select_blocks(block_scores(iq, ik, q_pos, params.block_size), q_pos, params)
    for p in range(seq_len):
        visible = set(range(p // params.block_size + 1))
        for h in range(heads):
            if {int(b) for b in selected[p, h] if b >= 0} != visible:
                return False
    return True


@pytest.mark.parametrize(
    "params, seq_len, expected",
    [
        (M3, 2048, True), (M3, 2049, False), (M3, 1, True), (M3, 1921, True), (M3, 4096, False),
        (TINY, 64, True), (TINY, 65, False), (TINY, 1, True), (TINY, 49, True),
        (FORCED, 24, True), (FORCED, 25, False),
        (NO_LOCAL, 64, True), (NO_LOCAL, 65, False),
    ],
)
def test_condition_at_its_boundaries_agrees_with_the_reference_selection(params, seq_len, expected):
    assert selects_every_block(seq_len, params) is expected
    assert every_query_selects_every_visible_block(seq_len, params) is expected


def test_limit_is_topk_blocks():
    assert full_selection_limit(M3) == 2048
    assert full_selection_limit(TINY) == 64
    for params in (M3, TINY, FORCED, NO_LOCAL):
        limit = full_selection_limit(params)
        assert selects_every_block(limit, params) and not selects_every_block(limit + 1, params)


def _extend_batch(kv_lens, extend_lens, width=None, seed=0):
    """An EXTEND double whose request ``b`` lives in pool row ``b + 1`` over shuffled slots."""
    gen = torch.Generator().manual_seed(seed)
    width = width or max(kv_lens) + 8
    req_to_token = torch.zeros(len(kv_lens) + 1, width, dtype=torch.int32)
    order = torch.randperm(sum(kv_lens) + 7, generator=gen).to(torch.int32)
    start = 0
    for b, n in enumerate(kv_lens):
        req_to_token[b + 1, :n] = order[start : start + n]
        start += n
    fb = forward_batch_for("EXTEND", req_to_token, torch.arange(1, len(kv_lens) + 1), kv_lens, extend_lens)
    return req_to_token, fb


@pytest.mark.parametrize(
    "params, kv_lens, extend_lens, dense",
    [
        # fresh 2K; a radix hit of 2,000 tokens + 48 new; the 2,049th token alone (decode-like
        # chunk); a fresh 2,049; a one-token prompt; a chunk after a prefix crossing the limit
        (M3, [2048, 2048, 2049, 2049, 1, 2100], [2048, 48, 1, 2049, 1, 52], [0, 1, 4]),
        # the tiny model's chunked prefill (chunk 48): first chunk of 65 dense, its second not;
        # a 64-token prompt's second chunk still dense; prefixes not multiples of the block
        (TINY, [48, 65, 64, 37, 70], [48, 17, 16, 5, 3], [0, 2, 3]),
        (TINY, [65, 200], [65, 8], []),
        (TINY, [10, 64], [10, 64], [0, 1]),
    ],
)
def test_plan_splits_the_batch_per_request(params, kv_lens, extend_lens, dense):
    req_to_token, fb = _extend_batch(kv_lens, extend_lens)
    plan = plan_full_selection(params, req_to_token, fb.req_pool_indices, kv_lens, extend_lens)
    if not dense:
        assert plan is None
        return
    starts = [sum(extend_lens[:b]) for b in range(len(kv_lens) + 1)]
    assert [(s.q_start, s.q_len, s.kv_len) for s in plan.spans] == [(starts[b], extend_lens[b], kv_lens[b]) for b in dense]
    assert [s.kv_start for s in plan.spans] == [sum(kv_lens[c] for c in dense[:i]) for i in range(len(dense))]
    want_slots = torch.cat([req_to_token[b + 1, : kv_lens[b]] for b in dense]).long()
    assert torch.equal(plan.slots, want_slots)
    sparse = [b for b in range(len(kv_lens)) if b not in dense]
    assert plan.sparse == tuple(sparse)
    if sparse:
        want_rows = torch.cat([torch.arange(starts[b], starts[b + 1]) for b in sparse])
        assert torch.equal(plan.sparse_rows, want_rows)
    else:
        assert plan.sparse_rows is None


def _random_request(seq_len, new, hq, hkv, d, seed, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    return rand(new, hq, d), rand(seq_len, hkv, d), rand(seq_len, hkv, d), rand(new, hkv, d), rand(seq_len, d)


@pytest.mark.parametrize("hq, hkv", [(16, 1), (16, 2)], ids=["gqa16", "gqa8"])
@pytest.mark.parametrize("seq_len, new", [(1, 1), (17, 17), (40, 40), (64, 64), (64, 16), (37, 5), (64, 1)])
def test_dense_causal_sdpa_equals_reference_msa_when_every_block_is_selected(hq, hkv, seq_len, new):
    d = 16
    q, k, v, iq, ik = _random_request(seq_len, new, hq, hkv, d, seed=seq_len * 100 + new)
    q_pos = torch.arange(seq_len - new, seq_len)
    want, selected = msa_attention(q, k, v, iq, ik, q_pos, TINY, scale=1 / math.sqrt(d))
    assert selects_every_block(seq_len, TINY)
    got = causal_sdpa(q, k, v, 1 / math.sqrt(d))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_one_token_past_the_limit_the_selection_matters():
    """At 65 tokens (tiny settings) the last query drops a block: dense attention is no longer MSA."""
    d, seq_len = 16, 65
    q, k, v, iq, ik = _random_request(seq_len, seq_len, 16, 1, d, seed=7)
    q_pos = torch.arange(seq_len)
    want, selected = msa_attention(q, k, v, iq, ik, q_pos, TINY, scale=1 / math.sqrt(d))
    got = causal_sdpa(q, k, v, 1 / math.sqrt(d))
    torch.testing.assert_close(got[:64], want[:64], rtol=1e-12, atol=1e-12)
    assert (got[64] - want[64]).abs().max() > 1e-3


def test_plan_attends_cached_fp8_values_times_their_scales():
    """An fp8 KV cache with per-layer scales: the dense requests read what the sparse kernels read."""
    d, hq, hkv, scale_k, scale_v = 16, 8, 1, 0.37, 1.9
    kv_lens, extend_lens = [40, 64, 70], [40, 9, 6]  # fresh, chunk after a prefix, sparse
    req_to_token, fb = _extend_batch(kv_lens, extend_lens, seed=3)
    gen = torch.Generator().manual_seed(3)
    slots = int(req_to_token.max()) + 1
    k_cache = (torch.randn(slots, hkv, d, generator=gen) / scale_k).to(torch.float8_e4m3fn)
    v_cache = (torch.randn(slots, hkv, d, generator=gen) / scale_v).to(torch.float8_e4m3fn)
    q = torch.randn(sum(extend_lens), hq, d, generator=gen)
    ik = torch.randn(slots, d, generator=gen)
    iq = torch.randn(sum(extend_lens), hkv, d, generator=gen)
    plan = plan_full_selection(TINY, req_to_token, fb.req_pool_indices, kv_lens, extend_lens)
    out = torch.full((q.shape[0], hq, d), float("nan"))
    plan.attend(q, k_cache, v_cache, out, 1 / math.sqrt(d), scale_k, scale_v)
    start = 0
    for b, (kv, new) in enumerate(zip(kv_lens, extend_lens)):
        rows = slice(start, start + new)
        start += new
        if b == 2:
            assert out[rows].isnan().all()  # left to the sparse kernels
            continue
        s = req_to_token[b + 1, :kv].long()
        want, _ = msa_attention(q[rows], k_cache[s], v_cache[s], iq[rows], ik[s], torch.arange(kv - new, kv), TINY,
                                scale=1 / math.sqrt(d), k_scale=scale_k, v_scale=scale_v)
        torch.testing.assert_close(out[rows], want, rtol=1e-5, atol=1e-5)


def test_switch_defaults_on_and_is_checked(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert full_selection_dense_enabled()
    monkeypatch.setenv(ENV, "0")
    assert not full_selection_dense_enabled()
    monkeypatch.setenv(ENV, "1")
    assert full_selection_dense_enabled()
    monkeypatch.setenv(ENV, "off")
    with pytest.raises(ValueError, match=ENV):
        full_selection_dense_enabled()
