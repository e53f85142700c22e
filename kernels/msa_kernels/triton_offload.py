"""Triton kernels of sparse offload: pages of a host-resident K/V store in and out of a device cache.

Under sparse offload (``sglang_m3.cache.offload_pool``) the main K/V of the sparse layers live in a
host store, token-major ``[slots, heads, dim]`` (SGLang's slot layout), and a per-layer device
*block cache* ``[entries + 1, block, heads, dim]`` holds the pages decode reads (a page is
``block`` consecutive slots = one MSA block; the last entry is a scratch entry). Two kernels move
data between them, both reading or writing the host store **directly from the device**:

* :func:`gather_pages`: copy whole pages ``host[src_pages[i]] -> cache[dst_entries[i]]`` (K and V),
  rows whose entry is ``skip_entry`` copying nothing. One launch per layer and fetch; the rows
  come from a static-shape fetch plan, so the launch is CUDA-graph safe and nothing is read on the
  host (no ``.item()``): rows that fetch nothing cost one load of their entry id.
* :func:`store_rows`: the K/V of new tokens into the host store at their slots and, where the
  slot's page is resident (``page_entry[slot // block] >= 0``), into that cache entry too
  (write-through), in one launch per layer.

Host memory as a kernel operand: page-locked host memory is mapped into the device's address
space (unified virtual addressing on every 64-bit CUDA platform: memory from ``cudaHostAlloc``,
which ``torch``'s ``pin_memory`` uses, and memory registered with ``cudaHostRegister`` with
default flags, which SGLang's HiCache host pools use, are "mapped and portable"). Triton's CUDA
launcher turns each pointer argument into a device address with ``cuPointerGetAttribute(
CU_POINTER_ATTRIBUTE_DEVICE_POINTER)`` and refuses only memory the device cannot reach ("cannot
be accessed from Triton (cpu tensor?)", the pageable case); pinned CPU tensors pass since
triton-lang/triton#1197. So the store is handed to the kernels as the CPU tensor it is, no device
view or copy engine involved; loads and stores cross PCIe / NVLink-C2C at kernel speed. Under the
Triton interpreter (CPU tests) every operand is an ordinary CPU tensor.

Exactness: bytes are copied, never converted (both sides hold the pool's storage dtype, e.g. the
uint8 view of an fp8 cache). Offsets are 64-bit (host stores exceed 2**31 elements).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def gather_pages_kernel(
    src_k_ptr, src_v_ptr, dst_k_ptr, dst_v_ptr, src_page_ptr, dst_entry_ptr, skip_entry,
    K_PAGE: tl.constexpr, V_PAGE: tl.constexpr, CHUNK: tl.constexpr,
):
    """Program ``(i, c)``: elements ``c * CHUNK ..`` of page ``src_page[i]`` of K and V to entry
    ``dst_entry[i]``, nothing when that entry is ``skip_entry`` (the loads are masked off)."""
    i = tl.program_id(0)
    c = tl.program_id(1)
    entry = tl.load(dst_entry_ptr + i)
    live = entry != skip_entry
    page = tl.load(src_page_ptr + i).to(tl.int64)
    entry = entry.to(tl.int64)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    k_ok = live & (offs < K_PAGE)
    x = tl.load(src_k_ptr + page * K_PAGE + offs, mask=k_ok)
    tl.store(dst_k_ptr + entry * K_PAGE + offs, x, mask=k_ok)
    v_ok = live & (offs < V_PAGE)
    y = tl.load(src_v_ptr + page * V_PAGE + offs, mask=v_ok)
    tl.store(dst_v_ptr + entry * V_PAGE + offs, y, mask=v_ok)


@triton.jit
def store_rows_kernel(
    loc_ptr, k_ptr, s_k_t, s_k_h, v_ptr, s_v_t, s_v_h,
    host_k_ptr, host_v_ptr, cache_k_ptr, cache_v_ptr, page_entry_ptr,
    H: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, HP: tl.constexpr, DP: tl.constexpr, DVP: tl.constexpr,
    BLOCK: tl.constexpr, WRITE_THROUGH: tl.constexpr,
):
    """Program ``t``: token t's K ``[H, D]`` and V ``[H, DV]`` to host slot ``loc[t]`` and, when its
    page is resident, to the same offset of its cache entry."""
    t = tl.program_id(0)
    slot = tl.load(loc_ptr + t).to(tl.int64)
    h = tl.arange(0, HP)
    d = tl.arange(0, DP)
    dv = tl.arange(0, DVP)
    k_mask = (h < H)[:, None] & (d < D)[None, :]
    v_mask = (h < H)[:, None] & (dv < DV)[None, :]
    tok = t.to(tl.int64)
    k = tl.load(k_ptr + tok * s_k_t + h[:, None] * s_k_h + d[None, :], mask=k_mask)
    v = tl.load(v_ptr + tok * s_v_t + h[:, None] * s_v_h + dv[None, :], mask=v_mask)
    k_row = h[:, None] * D + d[None, :]
    v_row = h[:, None] * DV + dv[None, :]
    tl.store(host_k_ptr + slot * (H * D) + k_row, k, mask=k_mask)
    tl.store(host_v_ptr + slot * (H * DV) + v_row, v, mask=v_mask)
    if WRITE_THROUGH:
        entry = tl.load(page_entry_ptr + slot // BLOCK)
        resident = entry >= 0
        row = entry.to(tl.int64) * BLOCK + slot % BLOCK
        tl.store(cache_k_ptr + row * (H * D) + k_row, k, mask=k_mask & resident)
        tl.store(cache_v_ptr + row * (H * DV) + v_row, v, mask=v_mask & resident)


def _pages(x: torch.Tensor, name: str) -> int:
    """Elements per page of a page-major buffer ``[pages, block, heads, dim]`` (contiguous)."""
    if not x.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {x.stride()}")
    return x[0].numel()


def gather_pages(
    src_k: torch.Tensor,
    src_v: torch.Tensor,
    dst_k: torch.Tensor,
    dst_v: torch.Tensor,
    src_pages: torch.Tensor,
    dst_entries: torch.Tensor,
    skip_entry: int = -1,
) -> None:
    """``dst[dst_entries[i]] = src[src_pages[i]]`` for K and V, except rows whose entry is ``skip_entry``.

    ``src_k / src_v``: the host store as pages ``[num_pages, block, heads, dim]`` (a view of the
    token-major store; host memory must be pinned or registered on CUDA). ``dst_k / dst_v``:
    ``[entries, block, heads, dim]`` on the device, same dtype. ``src_pages`` / ``dst_entries``:
    int64 or int32 ``[U]`` on the device (``src_pages[i]`` must be a real page wherever
    ``dst_entries[i] != skip_entry``). Fixed grid ``U x chunks``: graph safe.
    """
    if src_k.dtype != dst_k.dtype or src_v.dtype != dst_v.dtype:
        raise ValueError(f"gather_pages copies bytes: dtypes differ ({src_k.dtype} -> {dst_k.dtype}, {src_v.dtype} -> {dst_v.dtype})")
    k_page, v_page = _pages(src_k, "src_k"), _pages(src_v, "src_v")
    if _pages(dst_k, "dst_k") != k_page or _pages(dst_v, "dst_v") != v_page:
        raise ValueError(f"page shapes differ: src {tuple(src_k.shape[1:])} / {tuple(src_v.shape[1:])}, "
                         f"dst {tuple(dst_k.shape[1:])} / {tuple(dst_v.shape[1:])}")
    if src_pages.shape != dst_entries.shape or src_pages.dim() != 1:
        raise ValueError(f"src_pages {tuple(src_pages.shape)} and dst_entries {tuple(dst_entries.shape)} must be equal 1-D")
    rows = src_pages.shape[0]
    if rows == 0:
        return
    chunk = min(4096, triton.next_power_of_2(max(k_page, v_page)))
    grid = (rows, triton.cdiv(max(k_page, v_page), chunk))
    gather_pages_kernel[grid](
        src_k, src_v, dst_k, dst_v, src_pages, dst_entries, skip_entry,
        K_PAGE=k_page, V_PAGE=v_page, CHUNK=chunk, num_warps=4,
    )


def store_rows(
    loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    host_k: torch.Tensor,
    host_v: torch.Tensor,
    cache_k: torch.Tensor | None = None,
    cache_v: torch.Tensor | None = None,
    page_entry: torch.Tensor | None = None,
    block_size: int = 1,
) -> None:
    """Write ``k [N, H, D]`` / ``v [N, H, DV]`` at slots ``loc [N]`` of the host store
    ``host_k [slots, H, D]`` / ``host_v``, and (when ``cache_k`` is given) into the cache entry
    ``page_entry[slot // block_size]`` of each slot's page where that is >= 0.

    ``k`` / ``v`` may be strided views (unit stride along dim); their dtype must be the store's
    (the pool converts before it stores). ``cache_k / cache_v``: ``[entries, block_size, H, D]``.
    """
    n = loc.shape[0]
    if n == 0:
        return
    heads, d, dv = host_k.shape[1], host_k.shape[2], host_v.shape[2]
    k = k.reshape(n, heads, d) if k.dim() == 2 else k
    v = v.reshape(n, heads, dv) if v.dim() == 2 else v
    for name, x, buf in (("k", k, host_k), ("v", v, host_v)):
        if x.dim() != 3 or x.shape[1] != heads or x.shape[2] != buf.shape[2]:
            raise ValueError(f"{name} must be [{n}, {heads}, {buf.shape[2]}], got {tuple(x.shape)}")
        if x.dtype != buf.dtype:
            raise ValueError(f"{name} is {x.dtype}, the store holds {buf.dtype}: convert before storing")
        if not buf.is_contiguous():
            raise ValueError(f"the host {name} store must be contiguous, got strides {buf.stride()}")
    if k.stride(2) != 1:
        k = k.contiguous()
    if v.stride(2) != 1:
        v = v.contiguous()
    write_through = cache_k is not None
    if write_through:
        if page_entry is None or cache_v is None:
            raise ValueError("write-through needs cache_k, cache_v and page_entry together")
        if tuple(cache_k.shape[1:]) != (block_size, heads, d) or tuple(cache_v.shape[1:]) != (block_size, heads, dv):
            raise ValueError(f"cache pages must be [entries, {block_size}, {heads}, dim], got {tuple(cache_k.shape)}")
        if not (cache_k.is_contiguous() and cache_v.is_contiguous()):
            raise ValueError("the cache pages must be contiguous")
    else:
        cache_k, cache_v, page_entry = host_k, host_v, loc  # never read (WRITE_THROUGH=False)
    store_rows_kernel[(n,)](
        loc, k, k.stride(0), k.stride(1), v, v.stride(0), v.stride(1),
        host_k, host_v, cache_k, cache_v, page_entry,
        H=heads, D=d, DV=dv, HP=triton.next_power_of_2(heads), DP=triton.next_power_of_2(d),
        DVP=triton.next_power_of_2(dv), BLOCK=block_size, WRITE_THROUGH=write_through, num_warps=4,
    )
