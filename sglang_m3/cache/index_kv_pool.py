"""An MHA KV pool that also stores M3's per-token index keys of every sparse layer.

The index key of a token lives at the same slot id as its main K/V. Everything SGLang does with
slot ids (radix prefix sharing, chunked prefill, freeing, moving slots) therefore keeps the index
keys consistent with no extra bookkeeping; only operations that copy slot contents (move, host
offload) need to copy the index keys too, and they are overridden here.

Index keys are stored in the KV cache's dtype, except under an 8-bit main KV cache
(``--kv-cache-dtype fp8_e4m3``): there they keep the model's dtype (bf16 for M3 checkpoints), as
SGLang's own M3 pool does off Hopper, because fp8 keys change which blocks are selected. Opt-in
(``SGLANG_M3_INDEX_KEY_DTYPE=fp8_e4m3``, :mod:`sglang_m3.cache.index_key_dtype`) they are e4m3 with
one fp32 scale per token, kept in a second per-layer buffer under the same slot ids.
"""

from __future__ import annotations

import torch
from msa_kernels.reference import quantize_index_keys
from msa_kernels.triton_cache_insert import insert_kv_and_index
from sglang.srt.constants import GPU_MEMORY_TYPE_KV_CACHE
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

from sglang_m3.cache.index_key_dtype import index_key_bytes, index_key_fp8
from sglang_m3.config import M3TextSpec


class M3IndexedKVPool(MHATokenToKVPool):
    """``MHATokenToKVPool`` plus one ``[slots, index_head_dim]`` buffer per local sparse layer.

    Subclassed per model by ``indexed_pool_class`` so SGLang can keep constructing it with exactly
    the keyword arguments of the in-tree pool.
    """

    sparse_layer_ids: tuple[int, ...] = ()
    index_head_dim: int = 0
    index_key_fp8: bool = False  # e4m3 keys + per-token fp32 scales
    model_dtype: torch.dtype = torch.bfloat16  # the index keys' dtype under an 8-bit main KV cache

    def _create_buffers(self):
        super()._create_buffers()
        # Model-dtype index keys unless fp8 ones were asked for: an fp8 *main* KV cache alone does not
        # quantize them (benchmarks/results/index_fp8_quality.md measures what fp8 keys change).
        if self.index_key_fp8:
            self.index_dtype = torch.float8_e4m3fn
        else:
            self.index_dtype = index_key_storage_dtype(self.dtype, self.model_dtype)
        layers = self.local_sparse_layer_ids()
        rows = self.size + self.page_size
        # in SGLang's memory-saver region of the KV cache, as its K/V: --enable-memory-saver releases them together
        with self.memory_saver_adapter.region(GPU_MEMORY_TYPE_KV_CACHE):
            self.index_k_buffer = {
                layer_id: torch.zeros((rows, self.index_head_dim), dtype=self.index_dtype, device=self.device)
                for layer_id in layers
            }
            # {} for 16-bit keys, so every copy below can loop over both dicts
            self.index_k_scale_buffer = {
                layer_id: torch.zeros(rows, dtype=torch.float32, device=self.device)
                for layer_id in layers if self.index_key_fp8
            }

    def local_sparse_layer_ids(self) -> list[int]:
        """The sparse layers (global ids) whose KV this rank's pool holds."""
        return [layer_id for layer_id in self.sparse_layer_ids if self.start_layer <= layer_id < self.start_layer + self.layer_num]

    def _clear_buffers(self):
        super()._clear_buffers()
        del self.index_k_buffer, self.index_k_scale_buffer

    def set_index_k(self, layer_id: int, loc: torch.Tensor, index_k: torch.Tensor) -> None:
        if self.index_key_fp8:
            keys, scales = quantize_index_keys(index_k)
            self.index_k_buffer[layer_id][loc] = keys
            self.index_k_scale_buffer[layer_id][loc] = scales
        else:
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
        scale_buffer = None if index_k is None else self.index_k_scale_buffer.get(layer_id)
        insert_kv_and_index(loc, k, v, index_k, self.k_buffer[local], self.v_buffer[local], index_buffer, scale_buffer)
        return True

    def get_index_k_buffer(self, layer_id: int) -> torch.Tensor:
        return self.index_k_buffer[layer_id]

    def get_index_k_scale_buffer(self, layer_id: int) -> torch.Tensor | None:
        """Per-slot fp32 scales of an fp8 index-key buffer; None for 16-bit keys."""
        return self.index_k_scale_buffer.get(layer_id)

    def _index_buffers(self):
        yield from self.index_k_buffer.values()
        yield from self.index_k_scale_buffer.values()

    def index_k_size_bytes(self) -> int:
        return sum(buf.numel() * buf.element_size() for buf in self._index_buffers())

    def get_kv_size_bytes(self):
        k_bytes, v_bytes = super().get_kv_size_bytes()
        return k_bytes + self.index_k_size_bytes(), v_bytes

    def move_kv_cache(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor):
        super().move_kv_cache(tgt_loc, src_loc)
        for buf in self._index_buffers():
            buf[tgt_loc] = buf[src_loc]

    def get_cpu_copy(self, indices, mamba_indices=None, req_pool_index=None):
        kv = super().get_cpu_copy(indices, mamba_indices, req_pool_index)
        index = {layer_id: buf[indices].to("cpu") for layer_id, buf in self.index_k_buffer.items()}
        scales = {layer_id: buf[indices].to("cpu") for layer_id, buf in self.index_k_scale_buffer.items()}
        return {"kv": kv, "index_k": index, "index_k_scale": scales}

    def load_cpu_copy(self, kv_cache_cpu, indices, mamba_indices=None, req_pool_index=None):
        super().load_cpu_copy(kv_cache_cpu["kv"], indices, mamba_indices, req_pool_index)
        for buffers, key in ((self.index_k_buffer, "index_k"), (self.index_k_scale_buffer, "index_k_scale")):
            for layer_id, saved in kv_cache_cpu[key].items():
                buffers[layer_id][indices] = saved.to(buffers[layer_id].device)


def index_key_storage_dtype(kv_dtype: torch.dtype, model_dtype: torch.dtype) -> torch.dtype:
    """Dtype of unquantized index keys: the KV cache's, or the model's under an 8-bit KV cache."""
    return model_dtype if kv_dtype.itemsize == 1 else kv_dtype


def indexed_pool_class(spec: M3TextSpec, model_dtype: torch.dtype = torch.bfloat16) -> type[M3IndexedKVPool]:
    """A pool class bound to one model's sparse layers, index-key width, dtype (``model_dtype``, the
    model's activations, used under an 8-bit KV cache) and (from the environment) fp8 switch."""
    return type(
        "M3IndexedKVPool",
        (M3IndexedKVPool,),
        {
            "sparse_layer_ids": tuple(spec.sparse_layer_ids),
            "index_head_dim": spec.index_head_dim,
            "index_key_fp8": index_key_fp8(),
            "model_dtype": model_dtype,
        },
    )


def index_bytes_per_token(
    spec: M3TextSpec,
    start_layer: int,
    end_layer: int,
    kv_dtype: torch.dtype,
    fp8: bool | None = None,
    model_dtype: torch.dtype = torch.bfloat16,
) -> int:
    """Extra KV bytes per token that the index keys of this rank's sparse layers cost.

    ``fp8`` defaults to the configured index-key dtype (what :func:`indexed_pool_class` builds).
    """
    fp8 = index_key_fp8() if fp8 is None else fp8
    element = index_key_storage_dtype(kv_dtype, model_dtype).itemsize
    local = sum(1 for layer in spec.sparse_layer_ids if start_layer <= layer < end_layer)
    return local * index_key_bytes(spec.index_head_dim, fp8, element)
