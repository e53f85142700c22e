"""The device-side block cache of one sparse layer whose main K/V live in the host store.

``num_entries`` entries of one page (``block_size`` token slots) of K and V each, plus a scratch
entry that absorbs padded copies and writes to pages that are not resident. The cache is keyed by
host page, not by request: requests that share a radix prefix share its slots, so its pages and
their entries; a page stays valid as long as every write to its slots goes through
:meth:`SparseBlockCache.write_through` (the pool's ``set_kv_buffer``) or :meth:`invalidate`.

Attention reads K/V through :meth:`entry_table`, the request's page table remapped to cache
entries: the MSA attention kernels take a page table already, so on the GPU they can read the cache
with that table in place of the pool's, unchanged.

Counters (device tensors, read only when someone asks): distinct wanted pages found resident
(hits), fetched (misses) and the bytes those fetches copied host -> device.

Copies: with ``kernel_copies`` (CUDA: the host store is pinned) a fetch is one Triton launch that
reads the host store through its device address (:func:`msa_kernels.triton_offload.gather_pages`,
only the plan's misses move) and the pool writes new tokens with
:func:`msa_kernels.triton_offload.store_rows`; otherwise (the CPU platform, where host and
"device" are the same memory) torch indexing copies the plan's full static length.
"""

from __future__ import annotations

import torch
from msa_kernels.triton_offload import gather_pages, store_rows

from sglang_m3.cache.offload_fetch_plan import NEVER_USED, FetchPlan, plan_fetch


def block_cache_fixed_bytes(num_entries: int, block_size: int, head_num: int, head_dim: int, v_head_dim: int,
                            element_bytes: int) -> int:
    """Device bytes one :class:`SparseBlockCache` allocates whatever the slot pool's size: its entries
    and the scratch entry of K and V pages, the per-entry tables and the counters.

    SGLang sizes the slot pool from the memory left after a fixed cost and a cost per token; these
    bytes are part of the fixed cost (only ``page_entry``, 8 bytes per page, grows with the pool).
    """
    pages = (num_entries + 1) * block_size * head_num * (head_dim + v_head_dim) * element_bytes
    tables = 2 * (num_entries + 1) + 3  # entry_page and entry_age; clock, hits and misses
    return pages + tables * torch.int64.itemsize


def store_pages(pool_tokens: int, page_size: int, block_size: int) -> int:
    """MSA blocks a slot pool of ``pool_tokens`` slots spans with its padding page: the host store's
    pages, one page-table entry each in every block cache (the pool and its budget both count so)."""
    return (pool_tokens + page_size) // block_size


def block_cache_bytes(num_entries: int, num_pages: int, block_size: int, head_num: int, head_dim: int,
                      v_head_dim: int, element_bytes: int) -> int:
    """Device bytes one :class:`SparseBlockCache` over a host store of ``num_pages`` pages allocates:
    the fixed part and its page table (``page_entry``: one entry per page, and one for ``num_pages``,
    the page id an empty entry holds)."""
    fixed = block_cache_fixed_bytes(num_entries, block_size, head_num, head_dim, v_head_dim, element_bytes)
    return fixed + (num_pages + 1) * torch.int64.itemsize


class SparseBlockCache:
    def __init__(self, num_entries: int, num_pages: int, block_size: int, head_num: int, head_dim: int,
                 v_head_dim: int, dtype: torch.dtype, device, kernel_copies: bool = False):
        if num_entries < 1:
            raise ValueError(f"a block cache needs at least one entry, got {num_entries}")
        self.kernel_copies = kernel_copies
        self.num_entries = num_entries
        self.num_pages = num_pages
        self.block_size = block_size
        # zeros: the scratch entry is read (under a mask) where a block was not selected, so it must
        # hold finite values; it only ever receives real K/V afterwards.
        self.k_pages = torch.zeros((num_entries + 1, block_size, head_num, head_dim), dtype=dtype, device=device)
        self.v_pages = torch.zeros((num_entries + 1, block_size, head_num, v_head_dim), dtype=dtype, device=device)
        self.page_entry = torch.full((num_pages + 1,), -1, dtype=torch.int64, device=device)
        self.entry_page = torch.full((num_entries + 1,), num_pages, dtype=torch.int64, device=device)
        self.entry_age = torch.full((num_entries + 1,), NEVER_USED, dtype=torch.int64, device=device)
        self.clock = torch.zeros((), dtype=torch.int64, device=device)
        self.hits = torch.zeros((), dtype=torch.int64, device=device)
        self.misses = torch.zeros((), dtype=torch.int64, device=device)
        self.page_bytes = block_size * head_num * (head_dim + v_head_dim) * dtype.itemsize

    @property
    def scratch(self) -> int:
        return self.num_entries

    def fetch(self, wanted: torch.Tensor, host_k: torch.Tensor, host_v: torch.Tensor) -> FetchPlan:
        """Make every page of ``wanted`` (page ids, -1 padded) resident: one batched gather-copy.

        ``host_k [slots, heads, head_dim]`` / ``host_v``: the layer's host store. With
        ``kernel_copies`` one gather kernel copies the plan's misses (its other rows exit early);
        otherwise torch moves the plan's full (static) length, rows that fetch nothing copying a
        host page into the scratch entry. Device work only (graph safe) except the CPU check below.
        """
        plan = plan_fetch(wanted, self.page_entry, self.entry_age)
        if wanted.device.type == "cpu" and int(plan.hits + plan.misses) > self.num_entries:
            raise RuntimeError(
                f"a fetch wants {int(plan.hits + plan.misses)} distinct pages, the block cache holds "
                f"{self.num_entries}: the backend's rounds must keep within the cache")
        evicted = self.entry_page[plan.fill_entries]
        self.page_entry.index_fill_(0, evicted, -1)  # no host-staged value: graph capture safe
        self.page_entry[plan.fill_pages] = plan.fill_entries
        self.entry_page[plan.fill_entries] = plan.fill_pages
        self.entry_age[plan.used_entries] = self.clock
        self.clock += 1
        if self.kernel_copies:
            gather_pages(self.as_pages(host_k), self.as_pages(host_v), self.k_pages, self.v_pages,
                         plan.fill_pages, plan.fill_entries, skip_entry=self.scratch)
        else:
            source = plan.fill_pages.clamp(max=self.num_pages - 1)
            self.k_pages[plan.fill_entries] = self.as_pages(host_k)[source]
            self.v_pages[plan.fill_entries] = self.as_pages(host_v)[source]
        self.hits += plan.hits
        self.misses += plan.misses
        return plan

    def device_bytes(self) -> int:
        """Bytes this cache holds on its device: pages, tables and counters."""
        return sum(tensor.nbytes for tensor in vars(self).values() if isinstance(tensor, torch.Tensor))

    def as_pages(self, host: torch.Tensor) -> torch.Tensor:
        """The token-major store ``[slots, heads, dim]`` as ``[num_pages, block, heads, dim]``."""
        return host[: self.num_pages * self.block_size].view(self.num_pages, self.block_size, *host.shape[1:])

    def entry_table(self, page_table: torch.Tensor) -> torch.Tensor:
        """``page_table`` (any shape of page ids) with every page replaced by its entry (scratch where absent)."""
        entries = self.page_entry[page_table.long()]
        return torch.where(entries >= 0, entries, self.scratch)

    def write_rows(self, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor, host_k: torch.Tensor, host_v: torch.Tensor) -> None:
        """Store K/V at slots ``loc`` of the host store and mirror them into resident entries (one
        launch, ``kernel_copies`` only; values already in the storage dtype)."""
        store_rows(loc, k, v, host_k, host_v, self.k_pages, self.v_pages, self.page_entry, self.block_size)

    def write_through(self, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Mirror K/V just stored at slots ``loc`` of the host store into the entries holding their pages."""
        loc = loc.long()
        entries = self.entry_table(loc // self.block_size)
        offsets = loc % self.block_size
        self.k_pages[entries, offsets] = k.to(self.k_pages.dtype)
        self.v_pages[entries, offsets] = v.to(self.v_pages.dtype)

    def invalidate(self, pages: torch.Tensor | None = None) -> None:
        """Forget ``pages`` (all pages if None): their host slots were written behind the cache's back."""
        if pages is None:
            self.page_entry.fill_(-1)
            self.entry_page.fill_(self.num_pages)
            self.entry_age.fill_(NEVER_USED)
            return
        entries = self.entry_table(pages)
        self.entry_page[entries] = self.num_pages
        self.entry_age[entries] = NEVER_USED
        self.page_entry[pages.long()] = -1

    def rows(self, entries: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rows of the flattened cache holding the tokens at ``positions`` of a request whose
        block ``b`` sits in entry ``entries[b]`` (slots keep their offset within a page)."""
        return entries[positions // self.block_size] * self.block_size + positions % self.block_size

    def flat(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V as ``[(num_entries + 1) * block_size, heads, dim]`` rows."""
        return self.k_pages.flatten(0, 1), self.v_pages.flatten(0, 1)
