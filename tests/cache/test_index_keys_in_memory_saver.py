"""The index keys live in SGLang's memory-saver region of the KV cache, as its K/V buffers do.

Under ``--enable-memory-saver`` SGLang allocates its KV pools inside
``memory_saver_adapter.region(GPU_MEMORY_TYPE_KV_CACHE)``; ``release_memory_occupation`` frees
what that region holds and ``resume_memory_occupation`` maps it back. Index keys allocated outside
it stayed resident through a release. The CPU has no ``torch_memory_saver``: a recording adapter,
put where SGLang's pools create theirs, notes every tensor allocated inside each region, and SGLang's
own K/V buffers show it records what SGLang puts there.
"""

from __future__ import annotations

import types
from collections import defaultdict
from contextlib import contextmanager

import pytest
import torch
from sglang.srt.constants import GPU_MEMORY_TYPE_KV_CACHE
from sglang.srt.mem_cache import memory_pool
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from sglang_m3.cache.index_kv_pool import indexed_pool_class
from sglang_m3.cache.offload_pool import offload_pool_class
from sglang_m3.cache.offload_settings import OffloadShape
from sglang_m3.recipe.render import INDEX_KEY_DTYPE_ENV

SPEC = types.SimpleNamespace(sparse_layer_ids=(1, 2), index_head_dim=8, index_block_size=4, index_topk_blocks=2)
LAYERS, PAGE = 3, 4


class _Allocations(TorchDispatchMode):
    """The storages of every tensor torch creates while the mode is on."""

    def __init__(self):
        super().__init__()
        self.storages = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.storages |= {t.untyped_storage().data_ptr() for t in tree_leaves(out) if isinstance(t, torch.Tensor)}
        return out


class RecordingSaver:
    """A memory-saver adapter whose regions record what is allocated inside them, by tag."""

    def __init__(self):
        self.regions = defaultdict(set)

    @contextmanager
    def region(self, tag: str, enable_cpu_backup: bool = False):
        with _Allocations() as allocations:
            yield
        self.regions[tag] |= allocations.storages

    def holds(self, tag: str, tensor: torch.Tensor) -> bool:
        return tensor.untyped_storage().data_ptr() in self.regions[tag]


@pytest.fixture
def saver(monkeypatch):
    recording = RecordingSaver()
    monkeypatch.setattr(memory_pool.TorchMemorySaverAdapter, "create", staticmethod(lambda enable: recording))
    return recording


def build(pool_class):
    return pool_class(size=64, page_size=PAGE, dtype=torch.bfloat16, head_num=2, head_dim=8, layer_num=LAYERS,
                      device="cpu", enable_memory_saver=True)


@pytest.mark.parametrize("index_dtype", ["bf16", "fp8_e4m3"])
def test_index_keys_are_in_the_kv_cache_region(saver, monkeypatch, index_dtype):
    monkeypatch.setenv(INDEX_KEY_DTYPE_ENV, index_dtype)
    pool = build(indexed_pool_class(SPEC, torch.bfloat16))
    assert all(saver.holds(GPU_MEMORY_TYPE_KV_CACHE, buffer) for buffer in pool.k_buffer + pool.v_buffer)
    assert len(list(pool._index_buffers())) == (4 if index_dtype == "fp8_e4m3" else 2)
    for buffer in pool._index_buffers():
        assert saver.holds(GPU_MEMORY_TYPE_KV_CACHE, buffer)


def test_the_offload_pools_index_keys_are_in_the_kv_cache_region(saver):
    shape = OffloadShape(cache_blocks=8, block_size=PAGE, topk=2, kv_heads=2, max_query_tokens=1)
    pool = build(offload_pool_class(SPEC, torch.bfloat16, shape))
    dense = [layer for layer in range(LAYERS) if layer not in pool._offloaded_local_layers()]
    assert all(saver.holds(GPU_MEMORY_TYPE_KV_CACHE, pool.k_buffer[layer]) for layer in dense)
    for buffer in pool._index_buffers():
        assert saver.holds(GPU_MEMORY_TYPE_KV_CACHE, buffer)
