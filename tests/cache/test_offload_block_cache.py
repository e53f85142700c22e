"""The sparse-offload block cache and its fetch plan (CPU): hits, misses, LRU eviction, write-through.

A tiny host store of 12 pages of 4 slots; every page's K holds its page id, so which page an entry
holds can be read off its contents.
"""

from __future__ import annotations

import pytest
import torch

from sglang_m3.cache.offload_block_cache import SparseBlockCache
from sglang_m3.cache.offload_fetch_plan import plan_fetch

PAGES, BLOCK, HEADS, DIM = 12, 4, 2, 3


def host_store():
    k = torch.arange(PAGES).repeat_interleave(BLOCK).float()[:, None, None].expand(-1, HEADS, DIM).contiguous()
    return k, -k


def wanted(*pages, length=8):
    out = torch.full((length,), -1, dtype=torch.long)
    out[: len(pages)] = torch.tensor(pages, dtype=torch.long)
    return out


def resident(cache) -> set[int]:
    return {page for page in range(PAGES) if int(cache.page_entry[page]) >= 0}


def holds_its_page(cache, page) -> bool:
    entry = int(cache.page_entry[page])
    return bool((cache.k_pages[entry] == page).all() and (cache.v_pages[entry] == -page).all())


def test_first_fetch_misses_every_distinct_page_and_copies_it():
    cache = SparseBlockCache(4, PAGES, BLOCK, HEADS, DIM, DIM, torch.float32, "cpu")
    plan = cache.fetch(wanted(5, 2, 5, 9), *host_store())
    assert (int(plan.hits), int(plan.misses)) == (0, 3)
    assert resident(cache) == {2, 5, 9} and all(holds_its_page(cache, p) for p in (2, 5, 9))
    assert (int(cache.hits), int(cache.misses)) == (0, 3)
    assert cache.page_bytes == BLOCK * HEADS * 2 * DIM * 4


def test_resident_pages_hit_and_are_not_copied_again():
    cache = SparseBlockCache(4, PAGES, BLOCK, HEADS, DIM, DIM, torch.float32, "cpu")
    cache.fetch(wanted(1, 2), *host_store())
    plan = cache.fetch(wanted(2, 1, 3), *host_store())
    assert (int(plan.hits), int(plan.misses)) == (2, 1)
    assert int(plan.fill_entries.lt(cache.scratch).sum()) == 1  # one copy: page 3
    assert (int(cache.hits), int(cache.misses)) == (2, 3)


def test_least_recently_used_entry_is_evicted_first():
    cache = SparseBlockCache(3, PAGES, BLOCK, HEADS, DIM, DIM, torch.float32, "cpu")
    store = host_store()
    cache.fetch(wanted(0), *store)
    cache.fetch(wanted(1), *store)
    cache.fetch(wanted(2), *store)
    cache.fetch(wanted(0), *store)  # 1 is now the oldest
    cache.fetch(wanted(7), *store)
    assert resident(cache) == {0, 2, 7} and holds_its_page(cache, 7)
    cache.fetch(wanted(8), *store)  # then 2
    assert resident(cache) == {0, 7, 8}


def test_entries_a_fetch_hits_are_never_its_victims():
    cache = SparseBlockCache(3, PAGES, BLOCK, HEADS, DIM, DIM, torch.float32, "cpu")
    store = host_store()
    for page in (0, 1, 2):  # 0 is the oldest, yet wanted again alongside two new pages
        cache.fetch(wanted(page), *store)
    cache.fetch(wanted(0, 10), *store)
    assert resident(cache) == {0, 2, 10}
    cache.fetch(wanted(2, 0, 11), *store)  # cache full of wanted pages except the victim 10
    assert resident(cache) == {0, 2, 11} and all(holds_its_page(cache, p) for p in (0, 2, 11))


def test_a_fetch_larger_than_the_cache_is_refused():
    cache = SparseBlockCache(2, PAGES, BLOCK, HEADS, DIM, DIM, torch.float32, "cpu")
    with pytest.raises(RuntimeError, match="wants 3 distinct pages, the block cache holds 2"):
        cache.fetch(wanted(1, 2, 3), *host_store())


def test_plan_is_static_shaped_and_pads_into_the_sinks():
    cache = SparseBlockCache(4, PAGES, BLOCK, HEADS, DIM, DIM, torch.float32, "cpu")
    plan = plan_fetch(wanted(3, length=6), cache.page_entry, cache.entry_age)
    for tensor in (plan.fill_pages, plan.fill_entries, plan.used_entries):
        assert tensor.shape == (6,)
    assert sorted(plan.fill_pages.tolist()) == [3] + [PAGES] * 5
    assert sorted(plan.fill_entries.tolist())[-5:] == [cache.scratch] * 5


def test_write_through_updates_a_resident_page_and_spares_others():
    cache = SparseBlockCache(2, PAGES, BLOCK, HEADS, DIM, DIM, torch.float32, "cpu")
    cache.fetch(wanted(4), *host_store())
    loc = torch.tensor([4 * BLOCK + 1, 6 * BLOCK + 2])  # page 4 resident, page 6 not
    new_k = torch.full((2, HEADS, DIM), 100.0)
    cache.write_through(loc, new_k, -new_k)
    entry = int(cache.page_entry[4])
    assert (cache.k_pages[entry, 1] == 100).all() and (cache.k_pages[entry, 0] == 4).all()
    assert resident(cache) == {4}


def test_invalidated_pages_are_fetched_again_and_their_entries_reused_first():
    cache = SparseBlockCache(2, PAGES, BLOCK, HEADS, DIM, DIM, torch.float32, "cpu")
    store = host_store()
    cache.fetch(wanted(1, 2), *store)
    cache.invalidate(torch.tensor([2 * BLOCK + 3]) // BLOCK)
    assert resident(cache) == {1}
    plan = cache.fetch(wanted(2, 1), *store)
    assert (int(plan.hits), int(plan.misses)) == (1, 1) and holds_its_page(cache, 2)
    cache.invalidate()
    assert resident(cache) == set()


def test_entry_table_maps_absent_pages_to_the_scratch_entry():
    cache = SparseBlockCache(2, PAGES, BLOCK, HEADS, DIM, DIM, torch.float32, "cpu")
    cache.fetch(wanted(3), *host_store())
    table = cache.entry_table(torch.tensor([3, 4]))
    assert table.tolist() == [int(cache.page_entry[3]), cache.scratch]
    k_rows, _ = cache.flat()
    rows = cache.rows(table, torch.tensor([1, 2, 5]))
    assert k_rows[rows[:2]].eq(3).all() and int(rows[2]) // BLOCK == cache.scratch
