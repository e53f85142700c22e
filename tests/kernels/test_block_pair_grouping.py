"""The counting sort that groups block-major pairs by (kv head, page) (``triton_pair_plan``) against a torch model.

Inputs unlike the attention tests': two requests sharing their first pages (a radix prefix, so
one key collects pairs of both), selections with a random number of -1 padded slots, a pass that
starts inside the batch, and a page pool much larger than the batch. Checked: every key's count,
newest visible offset and block index; its pairs, as a set, exactly the pairs with that key; each
tile's key; the tile count. Under the Triton interpreter on CPU, and on a GPU where there is one
(there the pairs' order within a key follows atomic tickets, so only the sets are compared).
"""

import pytest
import torch

from msa_kernels import triton_pair_plan as tpp

BLOCK = 16


def _inputs(hkv: int, topk: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    num_pages = 200
    seq_lens = [150, 130]
    shared = 3  # both requests' first three blocks are the same pages
    blocks = [-(-s // BLOCK) for s in seq_lens]
    pages = torch.randperm(num_pages, generator=gen)
    table = torch.full((2, max(blocks)), -1, dtype=torch.int32)
    table[0, : blocks[0]] = pages[: blocks[0]].int()
    table[1, :shared] = table[0, :shared]
    table[1, shared : blocks[1]] = pages[blocks[0] : blocks[0] + blocks[1] - shared].int()
    extend = [90, 130]  # request 0 has a 60-token prefix
    req = torch.cat([torch.full((e,), r, dtype=torch.int32) for r, e in enumerate(extend)])
    pos = torch.cat([torch.arange(s - e, s, dtype=torch.int32) for s, e in zip(seq_lens, extend)])
    selected = torch.full((len(req), hkv, topk), -1, dtype=torch.int32)
    for t in range(len(req)):
        visible = int(pos[t]) // BLOCK + 1
        for h in range(hkv):
            count = int(torch.randint(0, min(topk, visible) + 1, (1,), generator=gen))
            chosen = torch.randperm(visible, generator=gen)[:count].sort().values
            selected[t, h, :count] = chosen.int()
    return table, req, pos, selected, num_pages


def _expected(table, req, pos, selected, num_pages, tok_base, num_tokens):
    hkv, topk = selected.shape[1:]
    by_key: dict[int, set[int]] = {}
    newest: dict[int, int] = {}
    block: dict[int, int] = {}
    for t in range(num_tokens):
        tok = tok_base + t
        for h in range(hkv):
            for s in range(topk):
                sel = int(selected[tok, h, s])
                if sel < 0:
                    continue
                key = h * num_pages + int(table[req[tok], sel])
                by_key.setdefault(key, set()).add((t * hkv + h) * topk + s)
                newest[key] = max(newest.get(key, 0), int(pos[tok]) - sel * BLOCK)
                assert block.setdefault(key, sel) == sel  # a page sits at one block index in every request
    return by_key, newest, block


def _check_grouping(api, device: str, hkv: int, topk: int, pairs_per_tile: int, seed: int):
    table, req, pos, selected, num_pages = _inputs(hkv, topk, seed)
    tok_base, num_tokens = 37, len(req) - 37 - 11  # a pass inside the batch
    grouped = api._group_pairs(
        table.to(device), req.to(device), pos.to(device), selected.to(device),
        tok_base, num_tokens, num_pages, BLOCK, pairs_per_tile,
    )
    by_key, newest, block = _expected(table, req, pos, selected, num_pages, tok_base, num_tokens)
    buckets = grouped.buckets.cpu()
    count = buckets[tpp.COUNT.value]
    assert {k: int(count[k]) for k in by_key} == {k: len(v) for k, v in by_key.items()}
    assert int(count.sum()) == sum(len(v) for v in by_key.values())
    pairs = grouped.pairs.cpu()
    tile_key = grouped.tile_key.cpu()
    num_tiles = int(grouped.num_tiles.cpu())
    expected_tiles = []
    for key in sorted(by_key):
        first = int(buckets[tpp.PAIR_OFFSET.value, key])
        assert set(pairs[first : first + len(by_key[key])].tolist()) == by_key[key], key
        assert int(buckets[tpp.NEWEST.value, key]) == newest[key]
        assert int(buckets[tpp.BLOCK_INDEX.value, key]) == block[key]
        assert int(buckets[tpp.TILE_OFFSET.value, key]) == len(expected_tiles)
        expected_tiles += [key] * -(-len(by_key[key]) // pairs_per_tile)
    assert num_tiles == len(expected_tiles)
    assert tile_key[:num_tiles].tolist() == expected_tiles


@pytest.mark.parametrize("hkv, topk, pairs_per_tile", [(2, 4, 4), (1, 4, 1), (4, 3, 8)])
def test_pairs_grouped_by_key_under_the_interpreter(interpreted_api, hkv, topk, pairs_per_tile):
    _check_grouping(interpreted_api, "cpu", hkv, topk, pairs_per_tile, seed=hkv * 10 + topk)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("hkv, topk, pairs_per_tile", [(2, 4, 4), (4, 16, 4)])
def test_pairs_grouped_by_key_on_gpu(hkv, topk, pairs_per_tile):
    from msa_kernels import api

    _check_grouping(api, "cuda", hkv, topk, pairs_per_tile, seed=hkv * 10 + topk)
