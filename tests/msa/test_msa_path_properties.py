"""Property tests of the SGLang-side MSA path (plan + slot-indexed cache) against brute force.

The oracle below is written independently of ``msa_kernels.reference``: plain Python loops over
queries, heads, blocks and tokens, in float64, straight from the wording of M3_FACTS s.2. Inputs
cover the traps listed there: partial last blocks, causal masking inside the own block, forced
local/init blocks that also rank, ragged batches, prefixes not aligned to the block size, several
query tokens per request, contexts with fewer visible blocks than k, non-contiguous cache slots.
"""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from msa_kernels.reference import MSAParams

from sglang_m3.msa.backend import attend_paged
from sglang_m3.msa.plan import plan_batch


def brute_force_request(q, k, v, iq, ik, q_pos, block, topk, local, init, scale):
    """Output [n, Hq, D] and chosen block sets per (query, kv head), by explicit loops."""
    n, hq, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    out = torch.zeros(n, hq, v.shape[-1], dtype=torch.float64)
    chosen_sets = []
    for i in range(n):
        p = int(q_pos[i])
        own = p // block
        visible = list(range(own + 1))
        per_head = []
        for g in range(hkv):
            score = {
                b: max(float(iq[i, g] @ ik[j]) for j in range(b * block, min((b + 1) * block, p + 1)))
                for b in visible
            }
            forced = {b for b in visible if b > own - local or b < init}
            if len(visible) <= topk:
                chosen = set(visible)
            else:
                rest = sorted((b for b in visible if b not in forced), key=lambda b: -score[b])
                chosen = forced | set(rest[: topk - len(forced)])
            per_head.append(chosen)
            keys = [j for j in range(p + 1) if j // block in chosen]
            for h in range(g * group, (g + 1) * group):
                logits = [float(q[i, h] @ k[j, g]) * scale for j in keys]
                top = max(logits)
                weights = [math.exp(x - top) for x in logits]
                total = sum(weights)
                for w, j in zip(weights, keys):
                    out[i, h] += (w / total) * v[j, g]
        chosen_sets.append(per_head)
    return out, chosen_sets


@st.composite
def msa_batches(draw):
    block = draw(st.sampled_from([1, 2, 3, 4, 8, 16]))
    topk = draw(st.integers(1, 6))
    local = draw(st.integers(0, min(2, topk)))
    init = draw(st.integers(0, topk - local))
    hkv = draw(st.integers(1, 3))
    group = draw(st.integers(1, 3))
    d = draw(st.sampled_from([4, 8]))
    requests = []
    for _ in range(draw(st.integers(1, 3))):
        kv_len = draw(st.integers(1, 70))
        query_len = draw(st.one_of(st.just(1), st.integers(1, min(8, kv_len)), st.just(kv_len)))
        requests.append((kv_len, query_len))
    seed = draw(st.integers(0, 2**31 - 1))
    return dict(block=block, topk=topk, local=local, init=init, hkv=hkv, group=group, d=d, requests=requests, seed=seed)


@settings(max_examples=60, deadline=None)
@given(msa_batches())
def test_paged_msa_matches_brute_force(case):
    gen = torch.Generator().manual_seed(case["seed"])
    hkv, hq, d = case["hkv"], case["hkv"] * case["group"], case["d"]
    total_kv = sum(kv for kv, _ in case["requests"])
    cache_slots = total_kv + 7
    k_cache = torch.randn(cache_slots, hkv, d, generator=gen, dtype=torch.float64)
    v_cache = torch.randn(cache_slots, hkv, d, generator=gen, dtype=torch.float64)
    ik_cache = torch.randn(cache_slots, d, generator=gen, dtype=torch.float64)
    # Scatter every request's tokens over random, non-contiguous slots (slot 0 unused, as in SGLang).
    permutation = (torch.randperm(cache_slots - 1, generator=gen) + 1).tolist()
    req_to_token = torch.zeros(len(case["requests"]) + 2, 80, dtype=torch.int64)
    pool_indices = torch.randperm(len(case["requests"]) + 2, generator=gen)[: len(case["requests"])]
    cursor = 0
    for row, (kv_len, _) in zip(pool_indices.tolist(), case["requests"]):
        req_to_token[row, :kv_len] = torch.tensor(permutation[cursor : cursor + kv_len])
        cursor += kv_len
    seq_lens = torch.tensor([kv for kv, _ in case["requests"]])
    query_lens = torch.tensor([ql for _, ql in case["requests"]])
    num_queries = int(query_lens.sum())
    q = torch.randn(num_queries, hq, d, generator=gen, dtype=torch.float64)
    index_q = torch.randn(num_queries, hkv, d, generator=gen, dtype=torch.float64)
    params = MSAParams(case["block"], case["topk"], case["local"], case["init"])
    scale = 1 / math.sqrt(d)

    plan = plan_batch(req_to_token, pool_indices, seq_lens, query_lens)
    got = attend_paged(plan, q, k_cache, v_cache, index_q, ik_cache, params, scale)

    for req, (kv_len, query_len) in zip(plan.requests, case["requests"]):
        rows = slice(req.query_start, req.query_start + query_len)
        slots = req.kv_slots
        expected, _ = brute_force_request(
            q[rows], k_cache[slots], v_cache[slots], index_q[rows], ik_cache[slots],
            torch.arange(kv_len - query_len, kv_len), case["block"], case["topk"], case["local"], case["init"], scale,
        )
        torch.testing.assert_close(got[rows], expected, rtol=1e-9, atol=1e-9)


@settings(max_examples=40, deadline=None)
@given(msa_batches())
def test_reference_selection_matches_brute_force_sets(case):
    """Selected blocks: sorted ascending, -1 padded, each a set equal to the brute-force choice."""
    from msa_kernels.reference import block_scores, select_blocks

    gen = torch.Generator().manual_seed(case["seed"])
    kv_len, query_len = case["requests"][0]
    hkv, d = case["hkv"], case["d"]
    ik = torch.randn(kv_len, d, generator=gen, dtype=torch.float64)
    iq = torch.randn(query_len, hkv, d, generator=gen, dtype=torch.float64)
    q_pos = torch.arange(kv_len - query_len, kv_len)
    params = MSAParams(case["block"], case["topk"], case["local"], case["init"])
    selected = select_blocks(block_scores(iq, ik, q_pos, params.block_size), q_pos, params)
    q = torch.zeros(query_len, hkv, d, dtype=torch.float64)
    kv = torch.zeros(kv_len, hkv, d, dtype=torch.float64)
    _, expected_sets = brute_force_request(q, kv, kv, iq, ik, q_pos, case["block"], case["topk"], case["local"], case["init"], 1.0)
    assert selected.shape == (query_len, hkv, case["topk"])
    for i in range(query_len):
        for g in range(hkv):
            row = selected[i, g].tolist()
            valid = [b for b in row if b >= 0]
            assert row == valid + [-1] * (len(row) - len(valid)), "padding must follow the chosen ids"
            assert valid == sorted(valid) and len(set(valid)) == len(valid), "ascending and duplicate-free"
            assert set(valid) == expected_sets[i][g]


def test_plan_rejects_more_queries_than_tokens():
    import pytest

    with pytest.raises(ValueError, match="queries 3 tokens but holds only 2"):
        plan_batch(torch.zeros(1, 4, dtype=torch.int64), torch.tensor([0]), torch.tensor([2]), torch.tensor([3]))


@st.composite
def forward_mode_batches(draw):
    """A batch of one forward mode, SGLang-shaped: a verify batch drafts the same count everywhere."""
    case = draw(msa_batches())
    mode = draw(st.sampled_from(["EXTEND", "DECODE", "TARGET_VERIFY"]))
    kv_lens = [kv for kv, _ in case["requests"]]
    if mode == "EXTEND":
        query_lens = [ql for _, ql in case["requests"]]
    elif mode == "DECODE":
        query_lens = [1] * len(kv_lens)
    else:
        q_len = draw(st.integers(1, min(6, min(kv_lens))))
        query_lens = [q_len] * len(kv_lens)
    return dict(case, mode=mode, requests=list(zip(kv_lens, query_lens)))


def _storing_runner(req_to_token, k_cache, v_cache, ik_cache):
    """A model runner whose pool writes and serves the given caches (slot-indexed, as SGLang's)."""
    from types import SimpleNamespace

    def set_kv_buffer(layer, write, k, v):
        k_cache[write.loc] = k.view(k_cache[write.loc].shape)
        v_cache[write.loc] = v.view(v_cache[write.loc].shape)

    def set_index_k(layer_id, loc, index_k):
        ik_cache[loc] = index_k

    pool = SimpleNamespace(
        set_kv_buffer=set_kv_buffer,
        set_index_k=set_index_k,
        get_key_buffer=lambda layer_id: k_cache,
        get_value_buffer=lambda layer_id: v_cache,
        get_index_k_buffer=lambda layer_id: ik_cache,
    )
    return SimpleNamespace(req_to_token_pool=SimpleNamespace(req_to_token=req_to_token), token_to_kv_pool=pool)


@settings(max_examples=40, deadline=None)
@given(forward_mode_batches())
def test_torch_backend_forward_modes_match_brute_force(case):
    """The torch backend on SGLang-shaped EXTEND / DECODE / TARGET_VERIFY batches: stores the new
    tokens at ``out_cache_loc``, attends at the positions SGLang hands the model, matches the oracle.

    Verify batches are built as SGLang builds them (drafts after ``seq_lens``, no extend lengths,
    the draft count in ``spec_info``); see ``tests/forward_batch_doubles.py``.
    """
    from types import SimpleNamespace

    from forward_batch_doubles import forward_batch_for

    from sglang_m3.msa.backend import MSATorchBackend

    gen = torch.Generator().manual_seed(case["seed"])
    hkv, hq, d = case["hkv"], case["hkv"] * case["group"], case["d"]
    kv_lens = [kv for kv, _ in case["requests"]]
    query_lens = [ql for _, ql in case["requests"]]
    cache_slots = sum(kv_lens) + 7
    k_want = torch.randn(cache_slots, hkv, d, generator=gen, dtype=torch.float64)
    v_want = torch.randn(cache_slots, hkv, d, generator=gen, dtype=torch.float64)
    ik_want = torch.randn(cache_slots, d, generator=gen, dtype=torch.float64)
    permutation = (torch.randperm(cache_slots - 1, generator=gen) + 1).tolist()
    req_to_token = torch.zeros(len(kv_lens) + 2, 80, dtype=torch.int64)
    pool_indices = torch.randperm(len(kv_lens) + 2, generator=gen)[: len(kv_lens)]
    cursor = 0
    for row, kv_len in zip(pool_indices.tolist(), kv_lens):
        req_to_token[row, :kv_len] = torch.tensor(permutation[cursor : cursor + kv_len])
        cursor += kv_len
    fb = forward_batch_for(case["mode"], req_to_token, pool_indices, kv_lens, query_lens)

    # The new tokens' K/V/index keys arrive with the forward; their slots start out as NaN.
    new = fb.out_cache_loc
    k_cache, v_cache, ik_cache = k_want.clone(), v_want.clone(), ik_want.clone()
    for cache in (k_cache, v_cache, ik_cache):
        cache[new] = float("nan")
    num_queries = sum(query_lens)
    q = torch.randn(num_queries, hq, d, generator=gen, dtype=torch.float64)
    index_q = torch.randn(num_queries, hkv, d, generator=gen, dtype=torch.float64)
    spec = SimpleNamespace(
        index_block_size=case["block"], index_topk_blocks=case["topk"],
        index_local_blocks=case["local"], index_init_blocks=case["init"],
    )
    layer = SimpleNamespace(layer_id=0, tp_q_head_num=hq, qk_head_dim=d, v_head_dim=d, scaling=1 / math.sqrt(d), k_scale=None, v_scale=None)
    backend = MSATorchBackend(_storing_runner(req_to_token, k_cache, v_cache, ik_cache), spec)
    backend.init_forward_metadata(fb)
    got = backend.forward_extend(
        q.view(num_queries, -1), k_want[new].view(num_queries, -1), v_want[new].view(num_queries, -1),
        layer, fb, index_q=index_q, index_k=ik_want[new],
    ).view(num_queries, hq, d)

    start = 0
    for row, kv_len, query_len in zip(pool_indices.tolist(), kv_lens, query_lens):
        rows = slice(start, start + query_len)
        start += query_len
        q_pos = torch.arange(kv_len - query_len, kv_len)
        assert fb.positions[rows].tolist() == q_pos.tolist(), "MSA must attend at the positions the model rotates with"
        slots = req_to_token[row, :kv_len]
        expected, _ = brute_force_request(
            q[rows], k_want[slots], v_want[slots], index_q[rows], ik_want[slots],
            q_pos, case["block"], case["topk"], case["local"], case["init"], layer.scaling,
        )
        torch.testing.assert_close(got[rows], expected, rtol=1e-9, atol=1e-9)


def test_plan_names_the_missing_forward_batch_field():
    import pytest
    from forward_batch_doubles import forward_batch_for

    from sglang_m3.msa.plan import plan_forward_batch

    req_to_token = torch.arange(2 * 40).view(2, 40)
    verify = forward_batch_for("TARGET_VERIFY", req_to_token, torch.tensor([1, 0]), [20, 30], [3, 3])
    verify.spec_info = None
    with pytest.raises(ValueError, match="forward_batch.spec_info"):
        plan_forward_batch(verify, req_to_token)
    extend = forward_batch_for("EXTEND", req_to_token, torch.tensor([1, 0]), [20, 30], [5, 30])
    extend.extend_seq_lens = None
    with pytest.raises(ValueError, match="forward_batch.extend_seq_lens is None"):
        plan_forward_batch(extend, req_to_token)
