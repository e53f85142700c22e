"""Sparse offload's Triton kernels under the interpreter (CPU tensors) against torch indexing.

``gather_pages`` copies whole host pages into cache entries, leaving the rows a fetch plan marks
with its scratch entry alone; ``store_rows`` writes new tokens into the host store and, where the
token's page is resident, into its cache entry. Bytes are copied, so every dtype the pool stores
(fp32, bf16, the uint8 view of an fp8 cache) must come out identical. On a GPU the same kernels
read pinned host memory: ``tests/gpu/test_offload_gpu.py``.
"""

from __future__ import annotations

import importlib

import pytest
import torch

PAGES, BLOCK, HEADS, DIM, VDIM = 9, 4, 2, 8, 16


@pytest.fixture(scope="module")
def offload_kernels():
    if torch.cuda.is_available():
        pytest.skip("interpreter tests run on CPU machines; tests/gpu/test_offload_gpu.py covers CUDA")
    from triton.runtime.interpreter import InterpretedFunction

    from msa_kernels import triton_offload

    if not isinstance(triton_offload.gather_pages_kernel, InterpretedFunction):
        importlib.reload(triton_offload)
    return triton_offload


def random_store(dtype, generator, rows=PAGES * BLOCK):
    def make(dim):
        x = torch.randn(rows, HEADS, dim, generator=generator)
        return (x * 50).to(torch.uint8) if dtype == torch.uint8 else x.to(dtype)

    return make(DIM), make(VDIM)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_gather_copies_the_plans_pages_and_skips_scratch_rows(offload_kernels, dtype):
    generator = torch.Generator().manual_seed(1)
    host_k, host_v = random_store(dtype, generator)
    entries = 6
    cache_k = torch.zeros(entries + 1, BLOCK, HEADS, DIM, dtype=dtype)
    cache_v = torch.zeros(entries + 1, BLOCK, HEADS, VDIM, dtype=dtype)
    scratch = entries
    # a fetch plan's rows: three misses, the rest pointed at the sink page / scratch entry
    src = torch.tensor([PAGES, 7, PAGES, 0, 5, PAGES])
    dst = torch.tensor([scratch, 2, scratch, 4, 0, scratch])
    before_k, before_v = cache_k.clone(), cache_v.clone()
    pages_k = host_k.view(PAGES, BLOCK, HEADS, DIM)
    pages_v = host_v.view(PAGES, BLOCK, HEADS, VDIM)
    offload_kernels.gather_pages(pages_k, pages_v, cache_k, cache_v, src, dst, skip_entry=scratch)
    want_k, want_v = before_k.clone(), before_v.clone()
    for page, entry in ((7, 2), (0, 4), (5, 0)):
        want_k[entry], want_v[entry] = pages_k[page], pages_v[page]
    assert torch.equal(cache_k, want_k) and torch.equal(cache_v, want_v)


def test_gather_without_skips_fills_a_staging_buffer(offload_kernels):
    generator = torch.Generator().manual_seed(2)
    host_k, host_v = random_store(torch.float32, generator)
    pages_k, pages_v = host_k.view(PAGES, BLOCK, HEADS, DIM), host_v.view(PAGES, BLOCK, HEADS, VDIM)
    src = torch.tensor([3, 3, 8, 1])  # a page staged twice (two requests sharing a radix prefix)
    stage_k = torch.full((4, BLOCK, HEADS, DIM), float("nan"))
    stage_v = torch.full((4, BLOCK, HEADS, VDIM), float("nan"))
    offload_kernels.gather_pages(pages_k, pages_v, stage_k, stage_v, src, torch.arange(4))
    assert torch.equal(stage_k, pages_k[src]) and torch.equal(stage_v, pages_v[src])


def test_gather_refuses_mismatched_pages(offload_kernels):
    host_k, host_v = random_store(torch.float32, torch.Generator().manual_seed(3))
    pages_k, pages_v = host_k.view(PAGES, BLOCK, HEADS, DIM), host_v.view(PAGES, BLOCK, HEADS, VDIM)
    with pytest.raises(ValueError, match="copies bytes: dtypes differ"):
        offload_kernels.gather_pages(pages_k, pages_v, torch.zeros(2, BLOCK, HEADS, DIM, dtype=torch.bfloat16),
                                     torch.zeros(2, BLOCK, HEADS, VDIM), torch.tensor([1]), torch.tensor([0]))
    with pytest.raises(ValueError, match="page shapes differ"):
        offload_kernels.gather_pages(pages_k, pages_v, torch.zeros(2, BLOCK, HEADS, VDIM),
                                     torch.zeros(2, BLOCK, HEADS, VDIM), torch.tensor([1]), torch.tensor([0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_store_writes_the_host_and_the_resident_entries(offload_kernels, dtype):
    generator = torch.Generator().manual_seed(4)
    host_k, host_v = random_store(dtype, generator)
    entries = 3
    cache_k = torch.zeros(entries + 1, BLOCK, HEADS, DIM, dtype=dtype)
    cache_v = torch.zeros(entries + 1, BLOCK, HEADS, VDIM, dtype=dtype)
    page_entry = torch.full((PAGES + 1,), -1, dtype=torch.long)
    page_entry[2], page_entry[6] = 1, 0  # pages 2 and 6 resident
    loc = torch.tensor([2 * BLOCK + 1, 5 * BLOCK, 6 * BLOCK + 3, 2 * BLOCK + 2])
    # K as a strided view into a packed projection (as the model hands it), V contiguous
    packed = torch.zeros(4, 3, HEADS, DIM, dtype=dtype)
    new_k, new_v = random_store(dtype, generator, rows=4)
    packed[:, 1] = new_k
    k = packed[:, 1]
    assert not k.is_contiguous()
    want = [t.clone() for t in (host_k, host_v, cache_k, cache_v)]
    offload_kernels.store_rows(loc, k, new_v, host_k, host_v, cache_k, cache_v, page_entry, BLOCK)
    want[0][loc], want[1][loc] = new_k, new_v
    for i, slot in enumerate(loc.tolist()):
        entry = int(page_entry[slot // BLOCK])
        if entry >= 0:
            want[2][entry, slot % BLOCK], want[3][entry, slot % BLOCK] = new_k[i], new_v[i]
    for got, expected in zip((host_k, host_v, cache_k, cache_v), want):
        assert torch.equal(got, expected)


def test_store_without_a_cache_writes_the_host_only(offload_kernels):
    host_k, host_v = random_store(torch.float32, torch.Generator().manual_seed(5))
    k, v = random_store(torch.float32, torch.Generator().manual_seed(6), rows=2)
    loc = torch.tensor([7, 30])
    offload_kernels.store_rows(loc, k.reshape(2, -1), v, host_k, host_v)  # [N, H * D] is accepted too
    assert torch.equal(host_k[loc], k) and torch.equal(host_v[loc], v)


def test_store_refuses_values_not_yet_in_the_storage_dtype(offload_kernels):
    host_k, host_v = random_store(torch.bfloat16, torch.Generator().manual_seed(7))
    k, v = random_store(torch.float32, torch.Generator().manual_seed(8), rows=1)
    with pytest.raises(ValueError, match="convert before storing"):
        offload_kernels.store_rows(torch.tensor([3]), k, v, host_k, host_v)
