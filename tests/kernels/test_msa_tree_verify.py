"""Draft-tree verification through the MSA decode kernels, under the Triton interpreter, vs the torch reference.

Each request's ``q_len`` new tokens form an EAGLE-style tree (``parents``, token 0 the root).
The reference answers every token as the decode query at the end of its root-to-token path:
over the request's prefix followed by its path, at position ``prefix + depth``
(``msa_kernels.paged_batch.reference_request``). Tiny geometry (blocks of 8 or 16 tokens, top-2/3)
makes the prefix sparse, puts the prefix tail and the drafts in one block, and lets paths cross
block boundaries: some drafts sit in a later block by slot than by position.
"""

import pytest
import torch

from msa_kernels.paged_batch import compare_with_reference, make_paged_batch
from msa_kernels.plan import page_table_from_req_to_token, plan_decode
from msa_kernels.reference import MSAParams

HQ, HKV, D = 4, 2, 32

#: parents of each tree's tokens: top-3 x 3 steps as EAGLE builds it (8 tokens, depth 3), a
#: deep chain-like tree, a wide one (every draft a child of the root), a top-2 tree of 5
TREES = {
    "top3": [-1, 0, 0, 0, 1, 1, 4, 2],
    "deep": [-1, 0, 1, 1, 3, 4, 2, 6],
    "wide": [-1, 0, 0, 0, 0, 0, 0, 0],
    "top2": [-1, 0, 0, 1, 2],
}


def _tree_batch(prefixes, trees, block, seed, fp8_index_keys=False):
    q_len = len(trees[0])
    batch = make_paged_batch(
        [p + q_len for p in prefixes], [q_len] * len(prefixes), HQ, HKV, D, D, block, torch.float32, "cpu",
        decode_q_len=q_len, generator=torch.Generator().manual_seed(seed),
    ).with_draft_trees(trees)
    return batch.with_fp8_index_keys() if fp8_index_keys else batch


def _plan(batch, params, num_sms=2):
    table = page_table_from_req_to_token(batch.req_to_token, torch.arange(len(batch.seq_lens)), max(batch.seq_lens), params.block_size)
    return plan_decode(
        params, table, torch.tensor(batch.seq_lens), q_len=batch.row_stride, num_kv_heads=HKV, num_sms=num_sms,
        tree=batch.draft_tree(),
    )


def _run(api, batch, params, num_sms=2):
    plan = _plan(batch, params, num_sms)
    return api.run_decode(plan, batch.q, batch.k_cache, batch.v_cache, batch.iq, batch.ik_cache, ik_scale=batch.ik_scale)


@pytest.mark.parametrize(
    "block, topk, prefixes, tree_names",
    [
        # prefix tails 5, 3 and 2 tokens short of a block: paths cross into the next block, where
        # later drafts sit by slot while their positions are still in the tail's block
        (16, 3, [75, 93, 62], ["top3", "deep", "top3"]),
        # blocks of 8: a deep path spans three blocks; a prefix that ends on a block boundary
        (8, 2, [37, 32, 29], ["deep", "wide", "top3"]),
        # top-2 trees of 5; a one-token prefix (everything visible is forced or fits the top-k)
        (8, 3, [1, 38], ["top2", "top2"]),
    ],
)
def test_tree_verify_answers_each_token_as_the_decode_of_its_path(interpreted_api, block, topk, prefixes, tree_names):
    params = MSAParams(block_size=block, topk=topk, local_blocks=1, init_blocks=0)
    batch = _tree_batch(prefixes, [TREES[name] for name in tree_names], block, seed=block + topk)
    out, selected = _run(interpreted_api, batch, params)
    agreement = compare_with_reference(batch, params, out, selected, rel_tol=1e-4)
    assert agreement.ok, agreement.failures
    assert agreement.rows == len(prefixes) * batch.row_stride * HKV


def test_split_attention_per_tree_token(interpreted_api):
    """Every tree token attends as its own tile, its blocks split over programs whose partials
    the last to finish merges (the path step in split 0 only)."""
    params = MSAParams(block_size=16, topk=3, local_blocks=1, init_blocks=0)
    batch = _tree_batch([75, 93, 62], [TREES["top3"], TREES["deep"], TREES["top3"]], 16, seed=19)
    plan = _plan(batch, params, num_sms=64)
    assert plan.attn_splits > 1
    out, selected = _run(interpreted_api, batch, params, num_sms=64)
    agreement = compare_with_reference(batch, params, out, selected, rel_tol=1e-4)
    assert agreement.ok, agreement.failures
    assert agreement.rows == 3 * batch.row_stride * HKV


def test_fp8_index_keys_and_init_blocks(interpreted_api):
    params = MSAParams(block_size=8, topk=3, local_blocks=1, init_blocks=1)
    batch = _tree_batch([30, 45], [TREES["top3"], TREES["deep"]], 8, seed=5, fp8_index_keys=True)
    out, selected = _run(interpreted_api, batch, params)
    agreement = compare_with_reference(batch, params, out, selected, rel_tol=1e-4)
    assert agreement.ok, agreement.failures


def test_siblings_never_reach_a_token(interpreted_api):
    """Changing one draft's key, value and index key changes the rows of its descendants and its
    own, and leaves every other row bit for bit as it was."""
    params = MSAParams(block_size=8, topk=2, local_blocks=1, init_blocks=0)
    tree = TREES["top3"]
    batch = _tree_batch([13], [tree], 8, seed=3)
    clean, _ = _run(interpreted_api, batch, params)
    changed_token = 1  # the root's first child: tokens 4, 5, 6 descend from it; 2, 3, 7 are off its branch
    slot = int(batch.req_to_token[0, 13 + changed_token])
    for cache in (batch.k_cache, batch.v_cache, batch.ik_cache):
        cache[slot] = 10 * torch.randn(cache[slot].shape, generator=torch.Generator().manual_seed(0))
    changed, _ = _run(interpreted_api, batch, params)
    reached = {token for token, path in enumerate(batch.paths_of(0)) if changed_token in path}
    assert reached == {1, 4, 5, 6}
    for token in range(len(tree)):
        same = torch.equal(changed[token], clean[token])
        assert same != (token in reached), f"token {token}: {'unchanged' if same else 'changed'}"


def test_the_recipe_rules_refuse_trees_past_what_the_plans_hold():
    """The recipe layer (no torch) restates the plans' ancestor-mask width; they must agree."""
    from msa_kernels.plan import DraftTree

    from sglang_m3.recipe.rules import MAX_DRAFT_TREE_TOKENS

    assert MAX_DRAFT_TREE_TOKENS == DraftTree.MAX_TOKENS
