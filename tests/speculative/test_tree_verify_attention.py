"""Verify batches of EAGLE draft trees on the CPU platform's attention: MSA layers and dense layers.

Trees come from random draft passes formed as SGLang's EAGLE worker forms them, built into
SGLang's verify layout (tree mask, positions, first-child / next-sibling links) by the torch
tree builder that ``test_torch_kernels`` checks against SGLang's Triton builder. The oracle
reads each token's root-to-token path from the links, not from the mask the code under test
reads, and answers every verify token as a decode query at ``prefix + depth`` over the prefix
followed by its path: ``brute_force_request`` (explicit loops, float64) for the MSA layers and a
plain softmax for the dense ones. Sibling branches' keys never reach the oracle, so a token
that scored, selected or attended them would differ. Blocks of 2-4 tokens and top-2/3 blocks
make the prefix sparse and the drafts cross block boundaries.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from sglang_m3.msa.verify_tree import draft_paths, draft_visibility
from sglang_m3.speculative.torch_kernels import FULL_MASK, QLEN_ONLY, build_tree
from tests.msa.test_msa_path_properties import _storing_runner, brute_force_request
from tests.speculative.draft_trees import random_draft_pass

#: (topk, num_steps, verify tokens): trees as served in the e2e test, wider and deeper ones.
TREES = [(3, 3, 8), (2, 3, 5), (4, 3, 8), (3, 4, 10)]
SEEDS = range(3)
HKV, GROUP, D = 2, 2, 8


def _tree_batch(seed: int, topk: int, num_steps: int, n: int, mode: int = FULL_MASK):
    """A random SGLang-shaped verify batch of draft trees over random caches (float64)."""
    gen = torch.Generator().manual_seed(seed)
    bs = int(torch.randint(1, 4, (1,), generator=gen))
    seq_lens = torch.randint(1, 40, (bs,), generator=gen)
    parent_list, selected = random_draft_pass(gen, bs, topk, num_steps, n)
    mask_size = n * int(seq_lens.sum()) + n * n * bs if mode == FULL_MASK else n * n * bs
    mask = torch.ones(mask_size, dtype=torch.bool)
    positions = torch.empty(bs * n, dtype=torch.long)
    retrieve = torch.full((3, bs, n), -1, dtype=torch.long)
    build_tree(parent_list, selected, seq_lens, mask, positions, *retrieve, topk, num_steps, n, mode)
    slots = int(seq_lens.sum()) + bs * n + 5
    req_to_token = torch.zeros(bs + 2, 64, dtype=torch.int64)
    pool_indices = torch.randperm(bs + 2, generator=gen)[:bs]
    permutation = (torch.randperm(slots - 1, generator=gen) + 1).tolist()
    cursor = 0
    for row, length in zip(pool_indices.tolist(), (seq_lens + n).tolist()):
        req_to_token[row, :length] = torch.tensor(permutation[cursor : cursor + length])
        cursor += length
    out_cache_loc = torch.cat([req_to_token[row, s : s + n] for row, s in zip(pool_indices.tolist(), seq_lens.tolist())])
    forward_batch = SimpleNamespace(
        forward_mode=_verify_mode(),
        seq_lens=seq_lens,
        seq_lens_cpu=seq_lens,
        req_pool_indices=pool_indices,
        extend_seq_lens=None,
        extend_seq_lens_cpu=None,
        positions=positions,
        out_cache_loc=out_cache_loc,
        spec_info=SimpleNamespace(tree_topk=topk, draft_token_num=n, num_tokens_per_req=n, custom_mask=mask),
    )
    caches = {name: torch.randn(slots, *shape, generator=gen, dtype=torch.float64)
              for name, shape in (("k", (HKV, D)), ("v", (HKV, D)), ("ik", (D,)))}
    queries = {name: torch.randn(bs * n, heads, D, generator=gen, dtype=torch.float64)
               for name, heads in (("q", HKV * GROUP), ("iq", HKV))}
    return forward_batch, req_to_token, retrieve[1:], caches, queries


def _verify_mode():
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    return ForwardMode.TARGET_VERIFY


def _paths_from_links(next_token: torch.Tensor, next_sibling: torch.Tensor) -> list[list[int]]:
    """Every token's root-to-token path, walking one request's first-child / next-sibling links."""
    paths = {0: [0]}
    pending = [0]
    while pending:
        parent = pending.pop()
        child = int(next_token[parent])
        while child != -1:
            paths[child] = paths[parent] + [child]
            pending.append(child)
            child = int(next_sibling[child])
    return [paths[token] for token in range(next_token.shape[0])]


def _oracle_rows(forward_batch, req_to_token, links):
    """``(query row, slots of the token's decode sequence, its position)`` of every verify token."""
    n = forward_batch.spec_info.draft_token_num
    next_token, next_sibling = links
    for b, (row, prefix) in enumerate(zip(forward_batch.req_pool_indices.tolist(), forward_batch.seq_lens.tolist())):
        paths = _paths_from_links(next_token[b], next_sibling[b])
        assert len(paths) == n, "every verify token of an EAGLE tree hangs off the root"
        for token, path in enumerate(paths):
            slots = torch.cat((req_to_token[row, :prefix], req_to_token[row, prefix + torch.tensor(path)]))
            yield b * n + token, slots, prefix + len(path) - 1


def _layer():
    return SimpleNamespace(
        layer_id=0, tp_q_head_num=HKV * GROUP, tp_k_head_num=HKV, qk_head_dim=D, v_head_dim=D,
        scaling=1 / math.sqrt(D), k_scale=None, v_scale=None,
    )


def _new_tokens(forward_batch, caches):
    """The verify tokens' K/V/index keys (they arrive with the forward), their slots reset to NaN."""
    new = forward_batch.out_cache_loc
    arriving = {name: cache[new].clone() for name, cache in caches.items()}
    for cache in caches.values():
        cache[new] = float("nan")
    return arriving


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("topk", "num_steps", "n"), TREES)
@pytest.mark.parametrize(("block", "topk_blocks", "local", "init"), [(2, 3, 1, 0), (4, 2, 1, 0), (3, 3, 1, 1)])
def test_msa_tree_verify_answers_each_token_as_a_decode_on_its_path(seed, topk, num_steps, n, block, topk_blocks, local, init):
    from sglang_m3.msa.backend import MSATorchBackend

    forward_batch, req_to_token, links, caches, queries = _tree_batch(seed, topk, num_steps, n)
    want = {name: cache.clone() for name, cache in caches.items()}
    arriving = _new_tokens(forward_batch, caches)
    spec = SimpleNamespace(index_block_size=block, index_topk_blocks=topk_blocks, index_local_blocks=local, index_init_blocks=init)
    backend = MSATorchBackend(_storing_runner(req_to_token, caches["k"], caches["v"], caches["ik"]), spec)
    backend.init_forward_metadata(forward_batch)
    rows = queries["q"].shape[0]
    layer = _layer()
    got = backend.forward_extend(
        queries["q"].view(rows, -1), arriving["k"].view(rows, -1), arriving["v"].view(rows, -1), layer, forward_batch,
        index_q=queries["iq"], index_k=arriving["ik"],
    ).view(rows, HKV * GROUP, D)
    for row, slots, position in _oracle_rows(forward_batch, req_to_token, links):
        assert int(forward_batch.positions[row]) == position, "the model rotates the token at prefix + depth"
        expected, _ = brute_force_request(
            queries["q"][row : row + 1], want["k"][slots], want["v"][slots], queries["iq"][row : row + 1], want["ik"][slots],
            torch.tensor([position]), block, topk_blocks, local, init, layer.scaling,
        )
        torch.testing.assert_close(got[row : row + 1], expected, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("topk", "num_steps", "n"), TREES)
def test_dense_tree_verify_attends_each_token_path(seed, topk, num_steps, n):
    from sglang_m3.speculative.torch_native import verify_extend

    forward_batch, req_to_token, links, caches, queries = _tree_batch(seed, topk, num_steps, n)
    want = {name: cache.clone() for name, cache in caches.items()}
    arriving = _new_tokens(forward_batch, caches)
    runner = _storing_runner(req_to_token, caches["k"], caches["v"], caches["ik"])
    backend = SimpleNamespace(token_to_kv_pool=runner.token_to_kv_pool, req_to_token_pool=runner.req_to_token_pool, swa_out_cache_loc=None)
    rows = queries["q"].shape[0]
    layer = _layer()
    got = verify_extend(
        backend, queries["q"].view(rows, -1), arriving["k"].view(rows, -1), arriving["v"].view(rows, -1), layer, forward_batch
    ).view(rows, HKV * GROUP, D)
    for row, slots, _ in _oracle_rows(forward_batch, req_to_token, links):
        k, v = want["k"][slots], want["v"][slots]
        for head in range(HKV * GROUP):
            weights = torch.softmax(k[:, head // GROUP] @ queries["q"][row, head] * layer.scaling, dim=0)
            torch.testing.assert_close(got[row, head], weights @ v[:, head // GROUP], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("seed", SEEDS)
def test_both_mask_layouts_give_the_same_paths(seed):
    full = _tree_batch(seed, 3, 3, 8, FULL_MASK)[0]
    qlen_only = _tree_batch(seed, 3, 3, 8, QLEN_ONLY)[0]
    prefix_lens = full.seq_lens.tolist()
    for a, b in zip(draft_visibility(full.spec_info.custom_mask, prefix_lens, 8),
                    draft_visibility(qlen_only.spec_info.custom_mask, prefix_lens, 8)):
        assert torch.equal(a, b)
        assert draft_paths(a)[0] == [0] and any(len(path) > 2 for path in draft_paths(a))


def test_bad_tree_masks_are_refused_by_name():
    with pytest.raises(ValueError, match="spec_info.custom_mask holds 10 entries"):
        draft_visibility(torch.ones(10, dtype=torch.bool), [5, 7], 3)
    siblings = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # two children of the root
    assert draft_paths(siblings) == [[0], [0, 1], [0, 2]]
    two_roots = torch.tensor([[1, 0, 0], [0, 1, 0], [1, 1, 1]], dtype=torch.bool)
    with pytest.raises(ValueError, match="custom_mask row 2 marks verify tokens"):
        draft_paths(two_roots)
