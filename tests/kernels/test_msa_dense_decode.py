"""Dense-attention layers over a decode / verify plan, under the Triton interpreter, vs the torch reference.

M3's dense layers attend every key before a token. The reference is the MSA reference with a
top-k wider than any request's blocks (every block chosen is dense causal attention), over the
same paged batches the sparse kernels are tested on: decode tokens, verify chains (ragged ones
too), draft trees, splits merged in the last program, fp8 K/V.
"""

import dataclasses

import pytest
import torch

from msa_kernels.paged_batch import make_paged_batch, reference_request
from msa_kernels.plan import page_table_from_req_to_token, plan_decode
from msa_kernels.reference import MSAParams

HQ, HKV, D = 4, 2, 32
#: a top-k no request reaches: the reference then chooses every block, i.e. attends densely
EVERY_BLOCK = 1 << 10


def _batch(seq_lens, q_len, block, seed, trees=None):
    batch = make_paged_batch(
        seq_lens, [q_len] * len(seq_lens), HQ, HKV, D, D, block, torch.float32, "cpu",
        decode_q_len=q_len, max_context=max(seq_lens) + 2 * block, generator=torch.Generator().manual_seed(seed),
    )
    return batch if trees is None else batch.with_draft_trees(trees)


def _plan(batch, params, q_len, num_sms, q_lens=None, tree=None):
    table = page_table_from_req_to_token(
        batch.req_to_token, torch.arange(len(batch.seq_lens)), batch.req_to_token.shape[1], params.block_size
    )
    return plan_decode(params, table, torch.tensor(batch.seq_lens), q_len=q_len, q_lens=q_lens, num_kv_heads=HKV,
                       num_sms=num_sms, tree=tree)


def _assert_dense(batch, params, out, rel_tol=1e-4):
    dense = dataclasses.replace(params, topk=EVERY_BLOCK)
    for b in range(len(batch.seq_lens)):
        expected, _, _ = reference_request(batch, b, dense)
        got = out[batch.rows_of(b)].float()
        assert torch.isfinite(got).all(), f"request {b}: non-finite rows"
        err = (got - expected).norm(dim=-1) / expected.norm(dim=-1).clamp_min(1e-6)
        assert float(err.max()) <= rel_tol, f"request {b}: rel err {float(err.max()):.3g}"


@pytest.mark.parametrize("q_len, ragged, num_sms", [(1, False, 24), (3, True, 24), (4, False, 2)])
def test_dense_decode_attends_every_key_before_each_token(interpreted_api, q_len, ragged, num_sms):
    """Decode and verify chains, split over several programs (num_sms 24) or one (num_sms 2);
    a ragged chain leaves its padded rows unwritten."""
    params = MSAParams(block_size=16, topk=2, local_blocks=1, init_blocks=0)
    seq_lens = [40, 150, 17, 129]
    batch = _batch(seq_lens, q_len, 16, seed=q_len + num_sms)
    q_lens = torch.tensor([q_len, 1, max(1, q_len - 1), q_len]) if ragged else None
    if q_lens is not None:
        batch.extend_lens = q_lens.tolist()
    plan = _plan(batch, params, q_len, num_sms, q_lens)
    assert (plan.dense_splits > 1) == (num_sms > 2)
    out = torch.full((plan.num_tokens, HQ, D), float("nan"))
    interpreted_api.decode_attention(plan, batch.q, batch.k_cache, batch.v_cache, None, out=out, dense=True)
    _assert_dense(batch, params, out)
    assert not plan.tickets.any()  # zero again for the next layer / replay
    if ragged:
        written = torch.cat([batch.rows_of(b) for b in range(len(seq_lens))])
        padded = torch.ones(plan.num_tokens, dtype=torch.bool)
        padded[written] = False
        assert torch.isnan(out[padded]).all()


@pytest.mark.parametrize("num_sms", [2, 64])
def test_dense_decode_of_draft_trees_reads_the_prefix_and_each_tokens_path(interpreted_api, num_sms):
    """Each draft token attends the request's prefix and its root-to-token path, never a sibling."""
    params = MSAParams(block_size=8, topk=2, local_blocks=1, init_blocks=0)
    trees = [[-1, 0, 0, 0, 1, 1, 4, 2], [-1, 0, 1, 1, 3, 4, 2, 6], [-1, 0, 0, 0, 0, 0, 0, 0]]
    prefixes = [37, 32, 1]
    batch = _batch([p + 8 for p in prefixes], 8, 8, seed=num_sms, trees=trees)
    plan = _plan(batch, params, 8, num_sms, tree=batch.draft_tree())
    out = interpreted_api.decode_attention(plan, batch.q, batch.k_cache, batch.v_cache, None, dense=True)
    _assert_dense(batch, params, out)


def test_dense_decode_reads_an_fp8_cache_through_its_scales(interpreted_api):
    params = MSAParams(block_size=16, topk=2, local_blocks=1, init_blocks=0)
    batch = _batch([70, 33], 2, 16, seed=5).with_fp8_kv(k_scale=0.5, v_scale=2.0)
    plan = _plan(batch, params, 2, 24)
    out = interpreted_api.decode_attention(
        plan, batch.q, batch.k_cache, batch.v_cache, None, k_scale=batch.k_scale, v_scale=batch.v_scale, dense=True
    )
    _assert_dense(batch, params, out)


def test_dense_decode_refuses_what_it_cannot_attend(interpreted_api):
    params = MSAParams(block_size=16, topk=2)
    batch = _batch([40], 1, 16, seed=3)
    plan = _plan(batch, params, 1, 2)
    attention = interpreted_api.decode_attention
    with pytest.raises(ValueError, match="the plan was made for 2"):
        attention(plan, batch.q, batch.k_cache[:, :1], batch.v_cache[:, :1], None, dense=True)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        attention(plan, batch.q[:, :3], batch.k_cache, batch.v_cache, None, dense=True)
    with pytest.raises(ValueError, match="no selected, requests or page_table"):
        attention(plan, batch.q, batch.k_cache, batch.v_cache, torch.zeros(1, 2, 2, dtype=torch.int32), dense=True)
    with pytest.raises(ValueError, match="or dense=True"):
        attention(plan, batch.q, batch.k_cache, batch.v_cache, None)
