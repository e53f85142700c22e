"""The hierarchical (host) cache tier for M3: host K/V plus the index keys of every sparse layer.

SGLang's hierarchical cache (``--enable-hierarchical-cache``) keeps evicted radix prefixes in a
host pool and loads them back, layer by layer, on a radix hit. Its stock MHA host pool only
knows K and V; with ``M3IndexedKVPool`` on the device (an ``MHATokenToKVPool`` subclass) SGLang
would pick that stock pool and bring back prefixes whose index keys are stale, so MSA would
choose blocks from another request's keys. ``M3IndexedKVPoolHost`` mirrors the index keys next to
the host K/V, under the same host slot ids, and moves them in the same backup (all layers) and
load (one layer at a time) calls; ``M3HostStackStrategy`` makes SGLang build it for the M3 pool.

Transfers: on CUDA the K/V go through SGLang's own host-pool kernels and the index keys, a small
fraction of the bytes (one head of ``index_head_dim`` per sparse layer), through torch indexing
on the transfer stream. On the CPU platform device and "host" memory are the same RAM, SGLang's
kernels (``sgl_kernel.kvcacheio``) and page pinning (``cudaHostRegister``) do not exist, and
every copy is a torch indexing copy; torch's CPU streams and events are synchronous no-ops, so
the controller's per-layer events are already satisfied when the copies return.

Not supported, refused by name when the server starts: an L3 storage backend (its page format
does not carry index keys), packed speculative draft KV pools, pipeline parallelism, layer
sharding and, on the CPU, host layouts other than ``layer_first`` and ``page_first``.
"""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import (
    StackBuildResult,
    StackStrategy,
    build_pool_entry,
    register_stack_strategy,
)
from sglang.srt.mem_cache.hicache_storage import PoolName
from sglang.srt.mem_cache.pool_host import HostPoolGroup
from sglang.srt.mem_cache.pool_host.common import get_allocator_type
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.runtime_context import get_memory

from sglang_m3.cache.index_key_dtype import index_key_bytes
from sglang_m3.cache.index_kv_pool import M3IndexedKVPool

#: Host layouts whose per-layer host views are token-indexable, so torch can copy into them.
CPU_HOST_LAYOUTS = ("layer_first", "page_first")


class M3IndexedKVPoolHost(MHATokenToKVPoolHost):
    """SGLang's MHA host pool plus ``index_k_host[i, slot]`` for the i-th local sparse layer."""

    def __init__(self, device_pool: M3IndexedKVPool, host_to_device_ratio: float, host_size: float,
                 page_size: int, layout: str, *, allocator_type: str = "default"):
        on_cpu = torch.device(device_pool.device).type == "cpu"
        if on_cpu and layout not in CPU_HOST_LAYOUTS:
            raise ValueError(
                f"--hicache-mem-layout {layout} is not supported for M3 on the CPU platform; "
                f"use one of {', '.join(CPU_HOST_LAYOUTS)}")
        # Set before the base constructor: it sizes the pool from get_size_per_token().
        self.index_layer_ids = tuple(sorted(device_pool.index_k_buffer))
        self.index_head_dim = device_pool.index_head_dim
        self.index_dtype = device_pool.index_dtype
        self.index_key_fp8 = device_pool.index_key_fp8  # fp8 keys travel with their per-token scales
        self.torch_transfers = on_cpu
        capacity = device_pool.size if device_pool.host_capacity_tokens is None else device_pool.host_capacity_tokens
        super().__init__(
            device_pool.get_device_pool_infos()[0].buffer_info, host_to_device_ratio, host_size, page_size, layout,
            # Pinning registers pages with CUDA; on the CPU platform there is nothing to pin for.
            pin_memory=not on_cpu, allocator_type=allocator_type, device_capacity_tokens=capacity,
            start_layer=device_pool.start_layer, end_layer=device_pool.end_layer, pool_label="kv+index",
        )
        self._index_row = {layer_id: row for row, layer_id in enumerate(self.index_layer_ids)}

    def index_bytes_per_token(self) -> int:
        return len(self.index_layer_ids) * index_key_bytes(self.index_head_dim, self.index_key_fp8, self.index_dtype.itemsize)

    def get_size_per_token(self):
        # --hicache-size and the host-memory check count the index keys as well as K/V.
        return super().get_size_per_token() + self.index_bytes_per_token()

    def init_kv_buffer(self):
        kv_buffer = super().init_kv_buffer()
        # Not zeroed: a host slot is always written by a backup before a load reads it.
        self.index_k_host = torch.empty(
            (len(self.index_layer_ids), self.size, self.index_head_dim), dtype=self.index_dtype,
            device="cpu", pin_memory=self.pin_memory)
        self.index_k_scale_host = torch.empty(
            (len(self.index_layer_ids), self.size), dtype=torch.float32, device="cpu", pin_memory=self.pin_memory
        ) if self.index_key_fp8 else None
        return kv_buffer

    def backup_from_device_all_layer(self, device_pool, host_indices, device_indices, io_backend):
        host_rows, device_rows = _on(host_indices, "cpu"), _on(device_indices, device_pool.device)
        if self.torch_transfers:
            for layer in range(self.target_layer_num):
                self.k_data_refs[layer][host_rows] = self.device_k_buffers[layer][device_rows]
                self.v_data_refs[layer][host_rows] = self.device_v_buffers[layer][device_rows]
        else:
            super().backup_from_device_all_layer(device_pool, host_indices, device_indices, io_backend)
        for row, layer_id in enumerate(self.index_layer_ids):
            self.index_k_host[row][host_rows] = device_pool.index_k_buffer[layer_id][device_rows].to("cpu")
            if self.index_key_fp8:
                self.index_k_scale_host[row][host_rows] = device_pool.index_k_scale_buffer[layer_id][device_rows].to("cpu")

    def load_to_device_per_layer(self, device_pool, host_indices, device_indices, layer_id, io_backend, *, is_draft=False):
        if is_draft or not 0 <= layer_id < self.target_layer_num:
            return
        host_rows, device_rows = _on(host_indices, "cpu"), _on(device_indices, device_pool.device)
        if self.torch_transfers:
            self.device_k_buffers[layer_id][device_rows] = self.k_data_refs[layer_id][host_rows]
            self.device_v_buffers[layer_id][device_rows] = self.v_data_refs[layer_id][host_rows]
        else:
            super().load_to_device_per_layer(device_pool, host_indices, device_indices, layer_id, io_backend)
        row = self._index_row.get(self.start_layer + layer_id)
        if row is not None:
            target = device_pool.index_k_buffer[self.start_layer + layer_id]
            target[device_rows] = self.index_k_host[row][host_rows].to(target.device, non_blocking=self.pin_memory)
            if self.index_key_fp8:
                scales = device_pool.index_k_scale_buffer[self.start_layer + layer_id]
                scales[device_rows] = self.index_k_scale_host[row][host_rows].to(scales.device, non_blocking=self.pin_memory)

    def _storage_unsupported(self, *args, **kwargs):
        raise NotImplementedError("M3's host pool has no storage page format for its index keys")

    get_data_page = set_from_flat_data_page = get_page_buffer_meta = _storage_unsupported


def _on(indices: torch.Tensor, device) -> torch.Tensor:
    return indices if indices.device == torch.device(device) else indices.to(device)


class M3HostStackStrategy(StackStrategy):
    """Builds the host tier (one KV anchor entry whose pool also carries the index keys) for
    SGLang's unified radix cache whenever the device pool is the M3 index-key pool."""

    def matches(self, kvcache, components):
        return isinstance(kvcache, M3IndexedKVPool) and components == {ComponentType.FULL}

    def build(self, *, cache, kvcache, params, server_args, load_cache_event, storage_backend=None,
              storage_backend_extra_config=None, prefetch_threshold=256, model_name=None,
              enable_storage_metrics=False):
        memory = get_memory()
        _refuse_unsupported(storage_backend, memory.hicache_host_memory_mode, params, kvcache)
        host_pool = M3IndexedKVPoolHost(
            kvcache, memory.hicache_ratio, memory.hicache_size, params.page_size, memory.hicache_mem_layout,
            allocator_type=get_allocator_type())
        layers = kvcache.layer_num
        group = HostPoolGroup([build_pool_entry(
            name=PoolName.KV, host_pool=host_pool, device_pool=kvcache,
            layer_mapping={layer: layer for layer in range(layers)}, transfer_layer_id_max=layers, is_anchor=True)])
        controller = HybridCacheController(
            params.token_to_kv_pool_allocator, group, params.page_size, params.tp_cache_group,
            load_cache_event=load_cache_event, attn_cp_group=params.attn_cp_cache_group,
            attn_tp_group=params.attn_tp_cache_group, pp_group=params.pp_cache_group,
            write_policy=memory.hicache_write_policy, io_backend=memory.hicache_io_backend,
            storage_backend=None, prefetch_threshold=prefetch_threshold, model_name=model_name,
            transfer_layer_id_max=layers, enable_storage_metrics=enable_storage_metrics,
            host_memory_mode=memory.hicache_host_memory_mode)
        return StackBuildResult(
            host_pool_group=group, cache_controller=controller,
            component_host_pools={ComponentType.FULL: host_pool}, pools_desc="KV + M3 index keys")


def _refuse_unsupported(storage_backend, host_memory_mode, params, kvcache) -> None:
    if storage_backend is not None:
        raise ValueError(
            f"--hicache-storage-backend {storage_backend} is not supported for M3: storage pages "
            "would lose the index keys MSA selects blocks with; use the host tier alone")
    if host_memory_mode != "cache":
        raise ValueError(f"--hicache-host-memory-mode {host_memory_mode} is not supported for M3 (needs a storage backend)")
    if params.mtp_draft_device_pools or params.sidecar_draft_device_pools:
        raise ValueError("--enable-hierarchical-cache with a speculative draft KV pool is not supported for M3 yet")
    if params.pp_size > 1:
        raise ValueError("--enable-hierarchical-cache is not supported for M3 with --pp-size > 1")
    if getattr(kvcache, "layer_shard_enabled", False):
        raise ValueError("--enable-hierarchical-cache is not supported for M3 with a layer-sharded KV pool")


_registered = False


def register_m3_host_stack() -> None:
    """Put the M3 strategy ahead of SGLang's catch-all MHA one (once per process)."""
    global _registered
    if not _registered:
        register_stack_strategy(M3HostStackStrategy())
        _registered = True
