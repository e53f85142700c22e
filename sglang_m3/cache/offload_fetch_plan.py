"""Which host pages one sparse layer's block cache must fetch, and into which entries.

A *page* is ``block_size`` consecutive token slots of the host store (with ``--page-size`` equal to
the MSA block size, one page is exactly one KV block of one request, or of a radix-shared prefix).
A decode / verify step selects blocks, the caller turns them into the pages they live in
(``wanted``, padded with -1 to a fixed length), and :func:`plan_fetch` decides, on the device and
with shapes that depend only on ``wanted``'s length and the cache size (so a CUDA graph can
replay it): which wanted pages are resident (hits), which are not (misses), and which entries
receive the misses: the least recently used entries that no hit of this fetch occupies, empty
entries first. Nothing here reads a value back to the host.

Sinks keep every update unconditional: ``page_entry`` has one row past the real pages (page id
``num_pages``) and the cache one entry past the real ones (entry id ``num_entries``); rows of the
plan that fetch nothing point their page at the sink page and their entry at the scratch entry.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Age of entries no fetch has used yet (and of invalidated ones): evicted before any other.
NEVER_USED = -1
_PROTECTED = torch.iinfo(torch.int64).max


@dataclass(frozen=True)
class FetchPlan:
    """One fetch of one layer's block cache; every tensor ``[len(wanted)]`` int64 on the device."""

    fill_pages: torch.Tensor  # host page to copy, the sink page where nothing is copied
    fill_entries: torch.Tensor  # cache entry it goes to, the scratch entry where nothing is copied
    used_entries: torch.Tensor  # entry each distinct wanted page occupies after the fetch (scratch elsewhere)
    hits: torch.Tensor  # 0-d: distinct wanted pages already resident
    misses: torch.Tensor  # 0-d: distinct wanted pages copied by this fetch


def plan_fetch(wanted: torch.Tensor, page_entry: torch.Tensor, entry_age: torch.Tensor) -> FetchPlan:
    """Plan bringing every page in ``wanted`` into the cache.

    ``wanted [U]``: page ids, -1 for padding, repeats allowed. ``page_entry [num_pages + 1]``: the
    entry holding each page, -1 where none (the last row is the sink). ``entry_age
    [num_entries + 1]``: when each entry was last used (:data:`NEVER_USED` for empty ones; the last
    one is the scratch entry's). The caller guarantees that the distinct pages of ``wanted`` fit
    in ``num_entries`` (the backend sizes its rounds so); then no entry a hit occupies is chosen
    as a victim.
    """
    sink_page = page_entry.shape[0] - 1
    scratch = entry_age.shape[0] - 1
    pages = torch.where(wanted >= 0, wanted, sink_page).sort().values
    distinct = torch.ones_like(pages, dtype=torch.bool)
    distinct[1:] = pages[1:] != pages[:-1]
    distinct &= pages < sink_page
    resident = page_entry[pages]
    hit = distinct & (resident >= 0)
    miss = distinct & (resident < 0)
    in_use = torch.zeros(scratch + 1, dtype=torch.bool, device=wanted.device)
    # index_fill_, not ``in_use[...] = True``: a Python value assigned through an index is staged
    # from host memory, which CUDA graph capture refuses
    in_use.index_fill_(0, torch.where(hit, resident, scratch), True)
    victims = torch.where(in_use[:scratch], _PROTECTED, entry_age[:scratch]).argsort(stable=True)
    rank = (torch.cumsum(miss, 0) - 1).clamp(0, scratch - 1)
    fill_entries = torch.where(miss, victims[rank], scratch)
    return FetchPlan(
        fill_pages=torch.where(miss, pages, sink_page),
        fill_entries=fill_entries,
        used_entries=torch.where(hit, resident, fill_entries),
        hits=hit.sum(),
        misses=miss.sum(),
    )
