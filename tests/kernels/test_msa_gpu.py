"""The MSA Triton kernels on a CUDA GPU in bf16 at M3 shapes vs the torch reference (fp32 on upcast inputs).

Covers the M3_FACTS s.2 traps: partial last blocks, causal masking inside the own block, a local
block that also ranks, ragged batches, prefixes that are not block multiples, contexts of
<= topk blocks (exactly dense), several query tokens per request (each selects on its own),
shuffled (non-contiguous) pages whose unused slots hold NaN, init blocks, and the per-rank
geometry under TP4 (16 q heads, 1 KV head); and speculative verification of EAGLE draft trees.
Skipped without CUDA.
"""

import pytest
import torch

from msa_kernels.paged_batch import compare_with_reference, make_paged_batch
from msa_kernels.plan import page_table_from_req_to_token, plan_decode, plan_prefill
from msa_kernels.reference import MSAParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

BLOCK = 128
REL_TOL = 2e-2  # bf16 operands: errors land between 1e-3 and 1e-2


def _batch(seq_lens, extend_lens, hq, hkv, seed, decode_q_len=0, max_context=None):
    gen = torch.Generator().manual_seed(seed)
    return make_paged_batch(
        seq_lens, extend_lens, hq, hkv, head_dim=128, index_dim=128, block_size=BLOCK,
        dtype=torch.bfloat16, device="cuda", decode_q_len=decode_q_len, max_context=max_context, generator=gen,
    )


def _table(batch, max_context):
    reqs = torch.arange(len(batch.seq_lens), device="cuda")
    return page_table_from_req_to_token(batch.req_to_token, reqs, max_context, BLOCK)


def _assert_agrees(agreement):
    assert agreement.ok, agreement.failures
    assert agreement.tie_swaps <= max(2, agreement.rows // 200)  # swaps only at rare near-ties


@pytest.mark.parametrize(
    "hq, hkv, init_blocks, seq_lens, extend_lens, attn_tile_tokens, block_major",
    [
        (64, 4, 0, [3000, 2600, 130, 5000, 64], [3000, 700, 1, 129, 64], 1, False),
        (64, 4, 0, [3000, 2600, 130, 5000, 64], [3000, 700, 1, 129, 64], 4, False),
        (64, 4, 0, [3000, 2600, 130, 5000, 64], [3000, 700, 1, 129, 64], 1, True),
        (64, 4, 1, [2049, 4100], [2049, 333], 1, True),
        (16, 1, 0, [6000, 1000], [500, 1000], 1, True),
    ],
)
def test_prefill_bf16(hq, hkv, init_blocks, seq_lens, extend_lens, attn_tile_tokens, block_major):
    from msa_kernels.api import run_prefill

    params = MSAParams(block_size=BLOCK, topk=16, local_blocks=1, init_blocks=init_blocks)
    batch = _batch(seq_lens, extend_lens, hq, hkv, seed=sum(seq_lens))
    plan = plan_prefill(
        params, _table(batch, max(seq_lens)), seq_lens, extend_lens, num_index_heads=hkv,
        attn_tile_tokens=attn_tile_tokens, block_major=block_major, block_major_chunk=1000,  # several passes
    )
    out, selected = run_prefill(plan, batch.q, batch.k_cache, batch.v_cache, batch.iq, batch.ik_cache)
    _assert_agrees(compare_with_reference(batch, params, out, selected, rel_tol=REL_TOL))


def test_block_major_prefill_is_deterministic():
    """Pairs reach their key's range by atomic tickets, so their order within a key (and so the
    tiles they share) changes between runs; a pair's output must not: two runs agree bit for bit."""
    from msa_kernels.api import run_prefill

    params = MSAParams(block_size=BLOCK, topk=16, local_blocks=1, init_blocks=0)
    seq_lens, extend_lens = [9000, 4000], [6000, 4000]
    batch = _batch(seq_lens, extend_lens, 64, 4, seed=5)
    plan = plan_prefill(params, _table(batch, max(seq_lens)), seq_lens, extend_lens, num_index_heads=4,
                        block_major=True, block_major_chunk=4096)
    runs = [run_prefill(plan, batch.q, batch.k_cache, batch.v_cache, batch.iq, batch.ik_cache) for _ in range(3)]
    for out, selected in runs[1:]:
        assert torch.equal(selected, runs[0][1])
        assert torch.equal(out, runs[0][0])


def test_block_major_pass_past_16k_tokens():
    """A 32K-token pass holds 2M pairs whose partials sit past 2**31 elements (pair x 16 rows x
    128): their addresses are 64-bit (an int32 address overflowed into an illegal access on an
    H200). The pass's output is the query-major attention's, to bf16 rounding."""
    from msa_kernels.api import run_prefill

    params = MSAParams(block_size=BLOCK, topk=16, local_blocks=1, init_blocks=0)
    n = 33000
    batch = _batch([n], [n], 64, 4, seed=7)
    table = _table(batch, n)
    forms = [plan_prefill(params, table, [n], [n], num_index_heads=4, block_major=major, block_major_chunk=32768)
             for major in (True, False)]
    (out_bm, sel_bm), (out_qm, sel_qm) = [run_prefill(plan, batch.q, batch.k_cache, batch.v_cache, batch.iq, batch.ik_cache)
                                          for plan in forms]
    assert torch.equal(sel_bm, sel_qm)
    torch.testing.assert_close(out_bm.float(), out_qm.float(), rtol=REL_TOL, atol=REL_TOL)


def test_prefill_split_index_bf16():
    """A 4K chunk after a 24K prefix (not a block multiple) with the split index scan + merge.

    16 q heads per 4 KV heads, not M3's 64: the dense reference's logits at 64 heads would need
    ~30 GB here; the indexer sees M3's shapes either way (4 index heads, dim 128, top-16).
    """
    from msa_kernels.api import run_prefill

    params = MSAParams(block_size=BLOCK, topk=16, local_blocks=1, init_blocks=0)
    seq_lens, extend_lens = [28100], [4096]
    batch = _batch(seq_lens, extend_lens, 16, 4, seed=28100)
    # forced, so the split path runs whatever the planner's per-GPU constants become
    plan = plan_prefill(params, _table(batch, max(seq_lens)), seq_lens, extend_lens, num_index_heads=4, index_splits=3)
    out, selected = run_prefill(plan, batch.q, batch.k_cache, batch.v_cache, batch.iq, batch.ik_cache)
    _assert_agrees(compare_with_reference(batch, params, out, selected, rel_tol=REL_TOL))


@pytest.mark.parametrize("q_len", [1, 2, 4, 8])
@pytest.mark.parametrize("hq, hkv", [(64, 4), (16, 1)])
def test_decode_bf16(q_len, hq, hkv):
    from msa_kernels.api import run_decode

    params = MSAParams(block_size=BLOCK, topk=16, local_blocks=1, init_blocks=0)
    seq_lens = [9, 128, 129, 2048, 2049, 5000, 20000, 33000]
    max_context = 40960
    batch = _batch(seq_lens, [q_len] * len(seq_lens), hq, hkv, seed=q_len, decode_q_len=q_len, max_context=max_context)
    q_lens = torch.tensor([min(q_len, s) for s in seq_lens], device="cuda")
    q_lens[1] = 1  # ragged: one request verifies fewer tokens
    batch.extend_lens = q_lens.tolist()
    seq = torch.tensor(seq_lens, device="cuda")
    plan = plan_decode(params, _table(batch, max_context), seq, q_len=q_len, q_lens=q_lens, num_kv_heads=hkv)
    out, selected = run_decode(plan, batch.q, batch.k_cache, batch.v_cache, batch.iq, batch.ik_cache)
    _assert_agrees(compare_with_reference(batch, params, out, selected, rel_tol=REL_TOL))


@pytest.mark.parametrize("hq, hkv", [(64, 4), (16, 1)])
def test_decode_draft_trees_bf16(hq, hkv):
    """EAGLE trees of 8 tokens (top-3 x 3 steps and deeper ones) verified at M3 shapes: each token
    as the decode query at the end of its path; prefixes end just before, on and after block
    boundaries, so paths cross into a block that holds later drafts by slot."""
    from msa_kernels.api import run_decode

    params = MSAParams(block_size=BLOCK, topk=16, local_blocks=1, init_blocks=0)
    prefixes = [5, 125, 128, 2045, 2049, 5000, 20477, 33000]
    trees = [[-1, 0, 0, 0, 1, 1, 4, 2], [-1, 0, 1, 1, 3, 4, 2, 6]] * 4
    seq_lens = [p + 8 for p in prefixes]
    batch = _batch(seq_lens, [8] * len(seq_lens), hq, hkv, seed=hkv, decode_q_len=8, max_context=40960).with_draft_trees(trees)
    plan = plan_decode(
        params, _table(batch, 40960), torch.tensor(seq_lens, device="cuda"), q_len=8, num_kv_heads=hkv,
        tree=batch.draft_tree(),
    )
    out, selected = run_decode(plan, batch.q, batch.k_cache, batch.v_cache, batch.iq, batch.ik_cache)
    _assert_agrees(compare_with_reference(batch, params, out, selected, rel_tol=REL_TOL))


def _assert_dense(batch, params, out):
    """Each request's rows against the reference with every block chosen (dense causal attention)."""
    import dataclasses

    from msa_kernels.paged_batch import reference_request

    every_block = dataclasses.replace(params, topk=1 << 12)
    for b in range(len(batch.seq_lens)):
        expected, _, _ = reference_request(batch, b, every_block)
        got = out[batch.rows_of(b)].float().cpu()
        err = (got - expected).norm(dim=-1) / expected.norm(dim=-1).clamp_min(1e-6)
        assert torch.isfinite(got).all() and float(err.max()) <= REL_TOL, f"request {b}: rel err {float(err.max()):.3g}"


@pytest.mark.parametrize("q_len", [1, 4, 8])
@pytest.mark.parametrize("hq, hkv", [(64, 4), (16, 1), (48, 8)])
def test_dense_decode_bf16(q_len, hq, hkv):
    """M3's dense layers over a decode / verify plan (``SGLANG_M3_DENSE_VERIFY=msa``), and a draft's
    extend over the verify window (48 query heads over 8, the mid-size EAGLE3 draft's; 8 tokens the
    tree's window): every key before each token, split over the keys, ragged chains included."""
    from msa_kernels.api import decode_attention

    params = MSAParams(block_size=BLOCK, topk=16, local_blocks=1, init_blocks=0)
    seq_lens = [9, 128, 129, 2049, 5000, 33000]
    batch = _batch(seq_lens, [q_len] * len(seq_lens), hq, hkv, seed=10 + q_len, decode_q_len=q_len, max_context=40960)
    q_lens = torch.tensor([min(q_len, s) for s in seq_lens], device="cuda")
    q_lens[1] = 1
    batch.extend_lens = q_lens.tolist()
    plan = plan_decode(params, _table(batch, 40960), torch.tensor(seq_lens, device="cuda"), q_len=q_len, q_lens=q_lens, num_kv_heads=hkv)
    _assert_dense(batch, params, decode_attention(plan, batch.q, batch.k_cache, batch.v_cache, None, dense=True))


def test_dense_decode_draft_trees_bf16():
    from msa_kernels.api import decode_attention

    params = MSAParams(block_size=BLOCK, topk=16, local_blocks=1, init_blocks=0)
    prefixes = [5, 128, 2045, 20477]
    trees = [[-1, 0, 0, 0, 1, 1, 4, 2], [-1, 0, 1, 1, 3, 4, 2, 6]] * 2
    seq_lens = [p + 8 for p in prefixes]
    batch = _batch(seq_lens, [8] * 4, 64, 4, seed=21, decode_q_len=8, max_context=24576).with_draft_trees(trees)
    plan = plan_decode(
        params, _table(batch, 24576), torch.tensor(seq_lens, device="cuda"), q_len=8, num_kv_heads=4, tree=batch.draft_tree(),
    )
    _assert_dense(batch, params, decode_attention(plan, batch.q, batch.k_cache, batch.v_cache, None, dense=True))


def test_decode_graph_replay_matches_eager():
    """A captured decode step replays to the eager result after the inputs change in place."""
    from msa_kernels.api import run_decode

    params = MSAParams(block_size=BLOCK, topk=16, local_blocks=1, init_blocks=0)
    seq_lens = [3000, 17000, 250]
    batch = _batch(seq_lens, [1] * 3, 64, 4, seed=11, decode_q_len=1, max_context=20480)
    plan = plan_decode(params, _table(batch, 20480), torch.tensor(seq_lens, device="cuda"), num_kv_heads=4)
    args = (plan, batch.q, batch.k_cache, batch.v_cache, batch.iq, batch.ik_cache)
    run_decode(*args)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, selected = run_decode(*args)
    batch.q.copy_(torch.randn_like(batch.q))
    batch.iq.copy_(torch.randn_like(batch.iq))
    for _ in range(3):  # the merge tickets must come back to zero after every replay
        graph.replay()
    torch.cuda.synchronize()
    assert not plan.tickets.any()
    eager_out, eager_sel = run_decode(*args)
    assert torch.equal(selected, eager_sel)
    torch.testing.assert_close(out, eager_out, rtol=0, atol=0)
    _assert_agrees(compare_with_reference(batch, params, out, selected, rel_tol=REL_TOL))


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_chained_decode_launches_match_unchained(shape, monkeypatch):
    """``run_decode`` chains its scan, top-k and attention by programmatic dependent launch on a
    Hopper GPU: the same bits as the kernels launched one after the other, eager and replayed from
    a graph after the inputs change in place (fp8 index keys too)."""
    from msa_kernels import api
    from msa_kernels.reference import quantize_index_keys

    if not api.chains_decode_launches(torch.device("cuda")):
        pytest.skip("programmatic dependent launch needs Hopper or later")
    params = MSAParams(block_size=BLOCK, topk=16, local_blocks=1, init_blocks=0)
    prefixes = [5, 2049, 20477, 33000]
    seq_lens = [p + 4 for p in prefixes]
    batch = _batch(seq_lens, [4] * 4, 64, 4, seed=31, decode_q_len=4, max_context=40960)
    tree = None
    if shape == "tree":
        batch = batch.with_draft_trees([[-1, 0, 0, 1], [-1, 0, 1, 2]] * 2)
        tree = batch.draft_tree()
    plan = plan_decode(params, _table(batch, 40960), torch.tensor(seq_lens, device="cuda"), q_len=4, num_kv_heads=4, tree=tree)
    ik8, scales = quantize_index_keys(batch.ik_cache)
    for keys, key_scale in ((batch.ik_cache, None), (ik8, scales.reshape(-1))):
        def step():
            return api.run_decode(plan, batch.q, batch.k_cache, batch.v_cache, batch.iq, keys, ik_scale=key_scale)

        def unchained():
            with monkeypatch.context() as env:
                env.setenv(api.DECODE_CHAIN_ENV, "0")
                return step()

        out, selected = step()
        want_out, want_sel = unchained()
        assert torch.equal(selected, want_sel)
        torch.testing.assert_close(out, want_out, rtol=0, atol=0)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graphed_out, graphed_sel = step()
        batch.q.copy_(torch.randn_like(batch.q))
        batch.iq.copy_(torch.randn_like(batch.iq))
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        assert not plan.tickets.any()
        want_out, want_sel = unchained()
        assert torch.equal(graphed_sel, want_sel)
        torch.testing.assert_close(graphed_out, want_out, rtol=0, atol=0)


def test_chained_decode_steps_back_to_back_match_unchained(monkeypatch):
    """Many chained decode steps queued with no synchronisation between them (48 requests of
    random lengths, q_len 1): each step's merge tickets must be back to zero before the next step's
    attention counts on them, and every step must equal the kernels launched one after another."""
    from msa_kernels import api

    if not api.chains_decode_launches(torch.device("cuda")):
        pytest.skip("programmatic dependent launch needs Hopper or later")
    params = MSAParams(block_size=BLOCK, topk=16, local_blocks=1, init_blocks=0)
    gen = torch.Generator().manual_seed(41)
    seq_lens = torch.randint(1, 40000, (48,), generator=gen).tolist()
    batch = _batch(seq_lens, [1] * 48, 64, 4, seed=41, decode_q_len=1, max_context=40960)
    plan = plan_decode(params, _table(batch, 40960), torch.tensor(seq_lens, device="cuda"), num_kv_heads=4)
    args = (plan, batch.q, batch.k_cache, batch.v_cache, batch.iq, batch.ik_cache)
    steps = [api.run_decode(*args) for _ in range(40)]
    torch.cuda.synchronize()
    assert not plan.tickets.any()
    with monkeypatch.context() as env:
        env.setenv(api.DECODE_CHAIN_ENV, "0")
        want_out, want_sel = api.run_decode(*args)
    for out, selected in steps:
        assert torch.equal(selected, want_sel)
        torch.testing.assert_close(out, want_out, rtol=0, atol=0)
