"""An MHA KV pool that also stores M3's per-token index keys of every sparse layer.

The index key of a token lives at the same slot id as its main K/V. Everything SGLang does with
slot ids (radix prefix sharing, chunked prefill, freeing, moving slots) therefore keeps the index
keys consistent with no extra bookkeeping; only operations that copy slot contents (move, host
offload) need to copy the index keys too, and they are overridden here.
"""

from __future__ import annotations

import torch
from msa_kernels.triton_cache_insert import insert_kv_and_index
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

from sglang_m3.config import M3TextSpec


class M3IndexedKVPool(MHATokenToKVPool):
    """``MHATokenToKVPool`` plus one ``[slots, index_head_dim]`` buffer per local sparse layer.

    Subclassed per model by ``indexed_pool_class`` so SGLang can keep constructing it with exactly
    the keyword arguments of the in-tree pool.
    """

    sparse_layer_ids: tuple[int, ...] = ()
    index_head_dim: int = 0

    def _create_buffers(self):
        super()._create_buffers()
        # fp8 index keys would blur the block ranking; keep them at least 16-bit.
        self.index_dtype = torch.bfloat16 if self.dtype.itemsize == 1 else self.dtype
        self.index_k_buffer = {
            layer_id: torch.zeros((self.size + self.page_size, self.index_head_dim), dtype=self.index_dtype, device=self.device)
            for layer_id in self.sparse_layer_ids
            if self.start_layer <= layer_id < self.start_layer + self.layer_num
        }

    def _clear_buffers(self):
        super()._clear_buffers()
        del self.index_k_buffer

    def set_index_k(self, layer_id: int, loc: torch.Tensor, index_k: torch.Tensor) -> None:
        self.index_k_buffer[layer_id][loc] = index_k.to(self.index_dtype)

    def store_fused(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index_k: torch.Tensor | None) -> bool:
        """K, V and the index key of one layer written in one Triton launch (CUDA tensors).

        Only plain row buffers take it; returns False, having written nothing, where SGLang's own
        ``set_kv_buffer`` must run instead: quantized caches (scales), fp8 caches stored as bytes,
        and non-NHD layouts (HND pages).
        """
        if self.is_quantized_kv_cache or self.store_dtype != self.dtype or self.kv_cache_layout != "nhd":
            return False
        local = layer_id - self.start_layer
        index_buffer = None if index_k is None else self.index_k_buffer[layer_id]
        insert_kv_and_index(loc, k, v, index_k, self.k_buffer[local], self.v_buffer[local], index_buffer)
        return True

    def get_index_k_buffer(self, layer_id: int) -> torch.Tensor:
        return self.index_k_buffer[layer_id]

    def index_k_size_bytes(self) -> int:
        return sum(buf.numel() * buf.element_size() for buf in self.index_k_buffer.values())

    def get_kv_size_bytes(self):
        k_bytes, v_bytes = super().get_kv_size_bytes()
        return k_bytes + self.index_k_size_bytes(), v_bytes

    def move_kv_cache(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor):
        super().move_kv_cache(tgt_loc, src_loc)
        for buf in self.index_k_buffer.values():
            buf[tgt_loc] = buf[src_loc]

    def get_cpu_copy(self, indices, mamba_indices=None, req_pool_index=None):
        kv = super().get_cpu_copy(indices, mamba_indices, req_pool_index)
        index = {layer_id: buf[indices].to("cpu") for layer_id, buf in self.index_k_buffer.items()}
        return {"kv": kv, "index_k": index}

    def load_cpu_copy(self, kv_cache_cpu, indices, mamba_indices=None, req_pool_index=None):
        super().load_cpu_copy(kv_cache_cpu["kv"], indices, mamba_indices, req_pool_index)
        for layer_id, saved in kv_cache_cpu["index_k"].items():
            self.index_k_buffer[layer_id][indices] = saved.to(self.index_k_buffer[layer_id].device)


def indexed_pool_class(spec: M3TextSpec) -> type[M3IndexedKVPool]:
    """A pool class bound to one model's sparse layers and index-key width."""
    return type(
        "M3IndexedKVPool",
        (M3IndexedKVPool,),
        {"sparse_layer_ids": tuple(spec.sparse_layer_ids), "index_head_dim": spec.index_head_dim},
    )


def index_bytes_per_token(spec: M3TextSpec, start_layer: int, end_layer: int, kv_dtype: torch.dtype) -> int:
    """Extra KV bytes per token that the index keys of this rank's sparse layers cost."""
    index_dtype = torch.bfloat16 if kv_dtype.itemsize == 1 else kv_dtype
    local = sum(1 for layer in spec.sparse_layer_ids if start_layer <= layer < end_layer)
    return local * spec.index_head_dim * index_dtype.itemsize
