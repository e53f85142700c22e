"""The M3 KV pool under sparse offload: sparse layers' main K/V in a host store, a block cache each.

Only the sparse layers' main K and V move: they are what grows with context (2 KB per token and
layer on M3) while MSA reads 16 blocks of them per query. Their index keys (every decode scans all
of them) and the dense layers' K/V stay in device buffers, as in :class:`M3IndexedKVPool`. The host
store keeps SGLang's slot layout (``k_buffer[layer][slot]``), so the radix cache, chunked prefill
and slot freeing work on it unchanged and requests sharing a prefix share its host K/V; on CUDA it
would be pinned so fetches can be asynchronous.

Every write to an offloaded layer lands in the host store and, where its page is resident, in the
layer's :class:`SparseBlockCache` entry too (write-through), so the block that decode is filling is
served fresh whether or not it is resident. Slot moves and bulk loads that bypass ``set_kv_buffer``
invalidate the pages they touch.

On CUDA (``kernel_copies``) the host store is page-locked host memory allocated the way SGLang's
HiCache allocates its host pools (anonymous mmap + ``cudaHostRegister``: exact size, where
torch's pinned allocator would round every buffer up to a power of two; :mod:`.page_locked`), and the device touches
it only through Triton kernels that address it directly (:mod:`msa_kernels.triton_offload`): a
write of new tokens is one launch that stores them into the host store and their resident cache
entries, a fetch one gather launch; no host sync, no copy engine, so both are CUDA-graph safe.
"""

from __future__ import annotations

import logging

import torch
from sglang.srt.constants import GPU_MEMORY_TYPE_KV_CACHE
from sglang.srt.mem_cache.memory_pool import unwrap_write_loc

from sglang_m3.cache.index_kv_pool import M3IndexedKVPool, indexed_pool_class
from sglang_m3.cache.offload_block_cache import SparseBlockCache, store_pages
from sglang_m3.cache.offload_settings import OffloadShape
from sglang_m3.cache.page_locked import HostRegisterError, page_locked_tensor
from sglang_m3.config import M3TextSpec

logger = logging.getLogger(__name__)


class M3SparseOffloadKVPool(M3IndexedKVPool):
    """``M3IndexedKVPool`` whose sparse layers' K/V buffers are the host store, plus their block caches."""

    offload_shape: OffloadShape | None = None  # set per server by :func:`offload_pool_class`
    #: K/V move through the Triton kernels of ``msa_kernels.triton_offload`` (None: on CUDA only;
    #: the CPU interpreter tests set True to run the CUDA path's kernels)
    kernel_copies: bool | None = None

    @property
    def uses_kernels(self) -> bool:
        if self.kernel_copies is not None:
            return self.kernel_copies
        return torch.device(self.device).type == "cuda"

    def _offloaded_local_layers(self) -> set[int]:
        return {layer_id - self.start_layer for layer_id in self.local_sparse_layer_ids()}

    def _create_buffers_normal(self):
        if self.kv_cache_layout != "nhd":
            raise ValueError(f"M3 sparse offload keeps token-major (NHD) K/V, not the {self.kv_cache_layout!r} layout")
        k_shape, v_shape = self._kv_buffer_shapes()
        offloaded = self._offloaded_local_layers()
        pin = torch.device(self.device).type == "cuda"
        host = {
            local: (host_store_tensor(k_shape, self.store_dtype, pin), host_store_tensor(v_shape, self.store_dtype, pin))
            for local in offloaded
        }
        with self.memory_saver_adapter.region(GPU_MEMORY_TYPE_KV_CACHE):
            device = {
                local: (torch.zeros(k_shape, dtype=self.store_dtype, device=self.device),
                        torch.zeros(v_shape, dtype=self.store_dtype, device=self.device))
                for local in range(self.layer_num) if local not in offloaded
            }
        buffers = {**host, **device}
        self.k_buffer = [buffers[local][0] for local in range(self.layer_num)]
        self.v_buffer = [buffers[local][1] for local in range(self.layer_num)]

    def _create_buffers(self):
        super()._create_buffers()
        shape = self.offload_shape
        rows = self.size + self.page_size
        if rows % shape.block_size:
            raise ValueError(f"the KV pool's {rows} slots are not whole MSA blocks of {shape.block_size}")
        self.block_caches = {
            layer_id: SparseBlockCache(shape.cache_blocks, store_pages(self.size, self.page_size, shape.block_size),
                                       shape.block_size, self.head_num, self.head_dim, self.v_head_dim, self.store_dtype,
                                       self.device, kernel_copies=self.uses_kernels)
            for layer_id in self.local_sparse_layer_ids()
        }
        host_bytes = sum(self.k_buffer[layer_id - self.start_layer].nbytes + self.v_buffer[layer_id - self.start_layer].nbytes
                         for layer_id in self.block_caches)
        cache_bytes = sum(cache.k_pages.nbytes + cache.v_pages.nbytes for cache in self.block_caches.values())
        self.staged_bytes = 0  # host -> device bytes of extend batches' staging copies (host count)
        logger.info("M3 sparse offload: %d sparse layers' K/V in a host store of %d slots (%.3f GB%s), block caches of "
                    "%d blocks per layer (%.3f GB on %s), %d request(s) per fetch round", len(self.block_caches), rows,
                    host_bytes / 1e9, ", page-locked, read and written by device kernels" if self.uses_kernels else "",
                    shape.cache_blocks, cache_bytes / 1e9, self.device, shape.requests_per_round)

    def _clear_buffers(self):
        super()._clear_buffers()
        del self.block_caches

    def get_kv_size_bytes(self):
        """(K, V) bytes in device memory, what SGLang logs and reports as the KV cache's size: the host
        store is not device memory, the block caches are (the index keys count with K, as in the base)."""
        k_bytes, v_bytes = super().get_kv_size_bytes()
        for layer_id, cache in self.block_caches.items():
            host_k, host_v = self.host_kv(layer_id)
            k_bytes += cache.device_bytes() - cache.v_pages.nbytes - host_k.nbytes  # K pages, tables, counters
            v_bytes += cache.v_pages.nbytes - host_v.nbytes
        return k_bytes, v_bytes

    def block_cache(self, layer_id: int) -> SparseBlockCache:
        return self.block_caches[layer_id]

    def fetch_pages(self, layer_id: int, wanted: torch.Tensor):
        """Bring the host pages ``wanted`` (-1 padded) of one layer into its block cache."""
        local = layer_id - self.start_layer
        return self.block_caches[layer_id].fetch(wanted, self.k_buffer[local], self.v_buffer[local])

    def cached_kv(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's block cache as ``[rows, heads, dim]`` K and V in the dtype attention reads."""
        return self.as_attention_dtype(*self.block_caches[layer_id].flat())

    def as_attention_dtype(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows in the storage dtype (e.g. uint8 of an fp8 cache) viewed as the dtype attention reads."""
        if self.store_dtype != self.dtype:
            return k.view(self.dtype), v.view(self.dtype)
        return k, v

    def host_kv(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's host store, ``[slots, heads, dim]`` K and V in the storage dtype."""
        local = layer_id - self.start_layer
        return self.k_buffer[local], self.v_buffer[local]

    def set_kv_buffer(self, layer, loc_info, cache_k, cache_v, k_scale=None, v_scale=None,
                      layer_id_override=None, dcp_kv_mask=None):
        super().set_kv_buffer(layer, loc_info, cache_k, cache_v, k_scale, v_scale, layer_id_override, dcp_kv_mask)
        layer_id = layer_id_override if layer_id_override is not None else layer.layer_id
        cache = self.block_caches.get(layer_id)
        if cache is not None and not self.uses_kernels:  # kernels: _store_kv_layer wrote through already
            loc = unwrap_write_loc(loc_info)[0]
            local = layer_id - self.start_layer
            # the stored rows, so the cache holds exactly what SGLang's conversion wrote to the host
            cache.write_through(loc, self.k_buffer[local][loc], self.v_buffer[local][loc])

    def _store_kv_layer(self, layer_idx, loc, cache_k, cache_v):
        # SGLang's per-layer write, after its dtype conversion (values as stored): an offloaded layer
        # on the kernel path stores into the host store and the resident cache entries in one launch.
        cache = self.block_caches.get(layer_idx + self.start_layer) if self.uses_kernels else None
        if cache is None:
            return super()._store_kv_layer(layer_idx, loc, cache_k, cache_v)
        cache.write_rows(loc, cache_k, cache_v, self.k_buffer[layer_idx], self.v_buffer[layer_idx])

    def store_fused(self, layer_id, loc, k, v, index_k) -> bool:
        # the fused Triton store writes device buffers; offloaded layers go through set_kv_buffer
        return False if layer_id in self.block_caches else super().store_fused(layer_id, loc, k, v, index_k)

    def _host_store_on_cuda(self) -> bool:
        """The host store sits beside a CUDA device (the kernel path on a GPU, not the interpreter)."""
        return self.uses_kernels and torch.device(self.device).type == "cuda"

    def _slot_move_pointer_buffers(self):
        # SGLang's slot-move kernel (and its warm-up at start-up under speculative decoding) takes raw
        # data pointers; a registered host buffer's device address may differ from its host one, so
        # on CUDA that kernel moves the device layers only and _move_kv_cache_impl the host rows.
        buffers = super()._slot_move_pointer_buffers()
        if not self._host_store_on_cuda():
            return buffers
        return [buffer for buffer in buffers if buffer.is_cuda]

    def _move_kv_cache_impl(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor):
        if not self._host_store_on_cuda():
            return super()._move_kv_cache_impl(tgt_loc, src_loc)
        offloaded = self._offloaded_local_layers()
        if self.use_native_move_kv_cache:
            from sglang.srt.mem_cache.memory_pool import move_kv_cache_native

            device_layers = [local for local in range(self.layer_num) if local not in offloaded]
            move_kv_cache_native([self.k_buffer[i] for i in device_layers], [self.v_buffer[i] for i in device_layers],
                                 tgt_loc, src_loc)
        else:
            super()._move_kv_cache_impl(tgt_loc, src_loc)
        # host rows, after every kernel queued so far has written them (rare: slot moves serve draft
        # trees, which sparse offload refuses)
        torch.cuda.current_stream().synchronize()
        tgt, src = tgt_loc.long().cpu(), src_loc.long().cpu()
        for local in offloaded:
            self.k_buffer[local][tgt] = self.k_buffer[local][src]
            self.v_buffer[local][tgt] = self.v_buffer[local][src]

    def move_kv_cache(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor):
        super().move_kv_cache(tgt_loc, src_loc)
        for cache in self.block_caches.values():
            cache.invalidate(tgt_loc.long() // cache.block_size)

    def load_cpu_copy(self, kv_cache_cpu, indices, mamba_indices=None, req_pool_index=None):
        super().load_cpu_copy(kv_cache_cpu, indices, mamba_indices, req_pool_index)
        for cache in self.block_caches.values():
            cache.invalidate()

    def offload_counters(self) -> dict[str, int]:
        """Totals over this rank's sparse layers since start-up (reads the device counters)."""
        caches = self.block_caches.values()
        return {
            "hits": sum(int(c.hits) for c in caches),
            "misses": sum(int(c.misses) for c in caches),
            "h2d_bytes": sum(int(c.misses) * c.page_bytes for c in caches),
            "staged_bytes": self.staged_bytes,
        }


def host_store_tensor(shape, dtype: torch.dtype, page_locked: bool) -> torch.Tensor:
    """A zeroed host tensor of the store; ``page_locked``: registered with CUDA (device-addressable).

    :func:`page_locked_tensor` gives exactly the bytes asked for; torch's pinned allocator (which
    rounds sizes up to powers of two) is the fallback where the driver refuses the registration.
    """
    if not page_locked:
        return torch.zeros(shape, dtype=dtype)
    try:
        return page_locked_tensor(tuple(shape), dtype)
    except HostRegisterError as error:
        logger.warning("sparse offload: %s; using torch's pinned allocator", error)
        return torch.zeros(shape, dtype=dtype, pin_memory=True)


def offload_pool_class(spec: M3TextSpec, model_dtype: torch.dtype, shape: OffloadShape) -> type[M3SparseOffloadKVPool]:
    """The offload pool bound to one model (through :func:`indexed_pool_class`) and one cache shape."""
    return type("M3SparseOffloadKVPool", (M3SparseOffloadKVPool, indexed_pool_class(spec, model_dtype)), {"offload_shape": shape})
