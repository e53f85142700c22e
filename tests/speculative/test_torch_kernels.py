"""The CPU platform's torch speculative kernels equal SGLang's Triton kernels on random inputs.

SGLang's kernels run here in Triton's interpreter (the root conftest sets ``TRITON_INTERPRET``
on a machine without CUDA); they are launched directly, not through the ``*_func`` wrappers the
plugin hooks. Every output buffer starts with the same fill on both sides, so cells a kernel
leaves alone are compared too. Draft trees are built the way SGLang's EAGLE worker builds them:
chains from its top-k-1 layout (parents ``-1 .. steps - 2``, drafts ``0 .. steps - 1``), trees
from random draft probabilities through its ``select_top_k_tokens`` and ``organize_draft_results``.
"""

from __future__ import annotations

import pytest
import torch
from sglang.kernels.ops.speculative.cache_locs import assign_draft_cache_locs_contiguous, assign_extend_cache_locs
from sglang.kernels.ops.speculative.eagle import fill_accept_out_cache_loc as triton_fill_accept_out_cache_loc
from sglang.kernels.ops.speculative.eagle import fill_bonus_tokens as triton_fill_bonus_tokens
from sglang.kernels.ops.speculative.spec_tree import sgl_build_tree_kernel_triton, verify_tree_greedy_triton
from sglang.srt.mem_cache.allocation import assign_req_to_token_pool
from sglang.srt.utils import next_power_of_2

from sglang_m3.speculative import torch_kernels
from sglang_m3.speculative.torch_kernels import FULL_MASK, QLEN_ONLY
from tests.speculative.draft_trees import random_draft_pass

POOL_ROWS, POOL_LEN = 6, 96
#: (topk, num_steps, num_draft_tokens): chains as served (3 steps / 4 tokens, 1 / 2, 5 / 6), then trees.
SHAPES = [(1, 3, 4), (1, 1, 2), (1, 5, 6), (2, 3, 5), (4, 3, 8), (3, 4, 10)]
SEEDS = range(4)


def _batch(seed: int):
    """``(generator, bs, req_pool_indices, req_to_token, seq_lens)``: distinct pool rows of random slots."""
    gen = torch.Generator().manual_seed(seed)
    bs = int(torch.randint(1, POOL_ROWS, (1,), generator=gen))
    req_pool_indices = torch.randperm(POOL_ROWS, generator=gen)[:bs].to(torch.int64)
    req_to_token = torch.randint(0, 10_000, (POOL_ROWS, POOL_LEN), generator=gen, dtype=torch.int32)
    seq_lens = torch.randint(1, 60, (bs,), generator=gen, dtype=torch.int64)
    return gen, bs, req_pool_indices, req_to_token, seq_lens


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("topk", "num_cols"), [(1, 3), (1, 4), (2, 3), (4, 5)])
@pytest.mark.parametrize("write", ["slots", "positions", "mrope"])
def test_draft_cache_locs_match_triton(seed, topk, num_cols, write):
    _, bs, req_pool_indices, req_to_token, seq_lens = _batch(seed)
    outputs = []
    for run in ("triton", "torch"):
        out = torch.full((bs * topk * num_cols,), -5, dtype=torch.int64)
        positions = torch.full((bs * topk,), -5, dtype=torch.int64) if write != "slots" else None
        mrope = torch.full((3, bs * topk), -5, dtype=torch.int64) if write == "mrope" else None
        if run == "triton":
            assign_draft_cache_locs_contiguous[(bs,)](
                req_pool_indices, req_to_token, seq_lens, out, POOL_LEN, topk, num_cols,
                positions=positions, mrope=mrope, BS=bs,
                WRITE_POSITIONS=positions is not None, WRITE_MROPE=mrope is not None,
            )
        else:
            torch_kernels.assign_draft_cache_locs(
                req_pool_indices, req_to_token, seq_lens, out, topk, num_cols, positions=positions, mrope=mrope
            )
        outputs.append((out, positions, mrope))
    for triton_out, torch_out in zip(*outputs):
        if triton_out is not None:
            assert torch.equal(torch_out, triton_out)
    assert (outputs[1][0] != -5).all()


@pytest.mark.parametrize("seed", SEEDS)
def test_req_to_token_update_matches_triton(seed):
    gen, bs, req_pool_indices, req_to_token, seq_lens = _batch(seed)
    new_lens = seq_lens + torch.randint(0, 9, (bs,), generator=gen)  # a request may add nothing
    out_cache_loc = torch.randint(0, 10_000, (int((new_lens - seq_lens).sum()),), generator=gen, dtype=torch.int64)
    tables = []
    for run in ("triton", "torch"):
        table = req_to_token.clone()
        if run == "triton":
            assign_req_to_token_pool[(bs,)](
                req_pool_indices, table, seq_lens, new_lens, out_cache_loc, POOL_LEN, next_power_of_2(bs)
            )
        else:
            torch_kernels.assign_req_to_token(req_pool_indices, table, seq_lens, new_lens, out_cache_loc, bs)
        tables.append(table)
    assert torch.equal(tables[1], tables[0])
    assert not torch.equal(tables[1], req_to_token) or out_cache_loc.numel() == 0


@pytest.mark.parametrize("seed", SEEDS)
def test_extend_cache_locs_match_triton(seed):
    """A draft tree's verify window: every request's slots ``seq_len .. seq_len + n - 1``."""
    gen, bs, req_pool_indices, req_to_token, seq_lens = _batch(seed)
    n = int(torch.randint(2, 9, (1,), generator=gen))
    expected = torch.full((bs * n,), -5, dtype=torch.int64)
    assign_extend_cache_locs[(bs,)](req_pool_indices, req_to_token, seq_lens, seq_lens + n, expected, POOL_LEN, next_power_of_2(bs))
    got = torch_kernels.assign_extend_cache_locs(req_pool_indices, req_to_token, seq_lens, seq_lens + n, bs, n)
    assert got.dtype == torch.int64 and torch.equal(got, expected)


@pytest.mark.parametrize("seed", SEEDS)
def test_accepted_path_cache_locs_match_triton(seed):
    """After a tree's verify: the accepted tokens' slots (sources) and each window's front (targets), packed."""
    gen = torch.Generator().manual_seed(seed)
    bs, n, depth = int(torch.randint(1, 6, (1,), generator=gen)), 8, 4
    out_cache_loc = 1 + torch.randperm(10_000, generator=gen)[: bs * n].to(torch.int64)  # no slot 0: the fill
    accept_lens = torch.randint(1, depth + 1, (bs,), generator=gen)
    accept_index = torch.full((bs, depth), -1, dtype=torch.int64)
    for b, length in enumerate(accept_lens.tolist()):
        accept_index[b, :length] = b * n + torch.randperm(n, generator=gen)[:length].sort().values
    size = bs * depth
    sources = [torch.zeros(size, dtype=torch.int64) for _ in range(2)]
    triton_fill_accept_out_cache_loc[(size,)](accept_index, out_cache_loc, sources[0], next_power_of_2(size))
    torch_kernels.fill_accept_out_cache_loc(accept_index, out_cache_loc, sources[1], size)
    assert torch.equal(sources[1], sources[0])
    targets = [torch.zeros(size, dtype=torch.int64) for _ in range(2)]
    window = out_cache_loc.view(bs, n)
    assign_extend_cache_locs[(bs,)](
        torch.arange(bs), window, torch.zeros_like(accept_lens), accept_lens, targets[0], n, next_power_of_2(bs)
    )
    torch_kernels.fill_front_out_cache_loc(accept_lens, out_cache_loc, targets[1])
    assert torch.equal(targets[1], targets[0])
    assert int((targets[1] != 0).sum()) == int(accept_lens.sum())


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("stride", [2, 4])
def test_bonus_tokens_match_triton(seed, stride):
    gen = torch.Generator().manual_seed(seed)
    bs = int(torch.randint(1, 9, (1,), generator=gen))
    accept_tokens = torch.randint(0, 512, (bs * stride,), generator=gen, dtype=torch.int32)
    accept_lens = torch.randint(1, stride + 1, (bs,), generator=gen, dtype=torch.int32)
    bonus = [torch.full((bs,), -5, dtype=torch.int32) for _ in range(2)]
    triton_fill_bonus_tokens[(bs,)](accept_tokens, accept_lens, bonus[0], stride)
    torch_kernels.fill_bonus_tokens(accept_tokens, accept_lens, bonus[1], stride, bs)
    assert torch.equal(bonus[1], bonus[0])


def _build_both(seed: int, topk: int, num_steps: int, n: int, mode: int):
    """The tree of one random draft pass built by SGLang's Triton builder and by the torch one."""
    gen = torch.Generator().manual_seed(seed)
    bs = int(torch.randint(1, 5, (1,), generator=gen))
    seq_lens = torch.randint(1, 40, (bs,), generator=gen, dtype=torch.int64)
    parent_list, selected = random_draft_pass(gen, bs, topk, num_steps, n)
    mask_size = n * int(seq_lens.sum()) + n * n * bs if mode == FULL_MASK else n * n * bs
    built = []
    for builder in (sgl_build_tree_kernel_triton, torch_kernels.build_tree):
        mask = torch.ones(mask_size, dtype=torch.bool)
        positions = torch.full((bs * n,), -5, dtype=torch.long)
        retrieve = torch.full((3, bs, n), -1, dtype=torch.long)
        builder(parent_list, selected, seq_lens, mask, positions, *retrieve, topk, num_steps, n, mode)
        built.append({"mask": mask, "positions": positions, "retrieve": retrieve})
    return built


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("topk", "num_steps", "num_draft_tokens"), SHAPES)
@pytest.mark.parametrize("mode", [FULL_MASK, QLEN_ONLY])
def test_tree_build_matches_triton(seed, topk, num_steps, num_draft_tokens, mode):
    triton_tree, torch_tree = _build_both(seed, topk, num_steps, num_draft_tokens, mode)
    for key in ("mask", "positions", "retrieve"):
        assert torch.equal(torch_tree[key], triton_tree[key]), key
    if topk == 1:  # a chain: draft j at depth j, each linked to the one before it
        n = num_draft_tokens
        first_positions = torch_tree["positions"][:n] - torch_tree["positions"][0]
        assert first_positions.tolist() == list(range(n))
        assert torch_tree["retrieve"][1, 0].tolist() == [*range(1, n), -1]


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize(("topk", "num_steps", "num_draft_tokens"), SHAPES)
def test_greedy_verify_matches_triton(seed, topk, num_steps, num_draft_tokens):
    n = num_draft_tokens
    tree = _build_both(seed, topk, num_steps, n, QLEN_ONLY)[1]
    retrieve_index, next_token, next_sibling = tree["retrieve"]
    bs = retrieve_index.shape[0]
    gen = torch.Generator().manual_seed(1000 + seed)
    # A vocabulary of 2 makes drafts match the target's token often, so paths of every length occur.
    candidates = torch.randint(0, 2, (bs, n), generator=gen, dtype=torch.int64)
    target_predict = torch.randint(0, 2, (bs, n), generator=gen, dtype=torch.int64)
    results = []
    for verifier in (verify_tree_greedy_triton, torch_kernels.verify_tree_greedy):
        predicts = torch.full((bs * n,), -5, dtype=torch.int32)
        accept_index = torch.full((bs, num_steps + 1), -1, dtype=torch.int32)
        accept_token_num = torch.full((bs,), -5, dtype=torch.int32)
        verifier(predicts, accept_index, accept_token_num, candidates, retrieve_index, next_token, next_sibling, target_predict)
        results.append((predicts, accept_index, accept_token_num))
    for torch_out, triton_out in zip(results[1], results[0]):
        assert torch.equal(torch_out, triton_out)


def test_greedy_verify_accepts_along_a_chain():
    """A chain whose drafts equal the target's tokens up to a mismatch: accepted exactly up to it."""
    n = 4
    retrieve = torch.full((3, 1, n), -1, dtype=torch.long)
    torch_kernels.build_tree(
        torch.arange(-1, 2).view(1, -1), torch.arange(3).view(1, -1), torch.tensor([10]),
        torch.ones(n * n, dtype=torch.bool), torch.empty(n, dtype=torch.long), *retrieve, 1, 3, n, QLEN_ONLY,
    )
    candidates = torch.tensor([[7, 21, 22, 99]])  # bonus token, then drafts 21, 22, 99
    target_predict = torch.tensor([[21, 22, 23, 24]])  # the target wants 21, 22, 23, ...
    predicts = torch.zeros(n, dtype=torch.int32)
    accept_index = torch.full((1, n), -1, dtype=torch.int32)
    accepted = torch.zeros(1, dtype=torch.int32)
    torch_kernels.verify_tree_greedy(predicts, accept_index, accepted, candidates, *retrieve, target_predict)
    assert accepted.tolist() == [2]
    assert accept_index.tolist() == [[0, 1, 2, -1]]
    assert predicts.tolist() == [21, 22, 23, 0]  # the bonus token 23 follows the last accepted draft
