"""What sparse offload costs in device memory against what SGLang's pool sizing charges for it.

SGLang turns a KV byte budget into a slot count (``KVCacheConfigurator.config_from_budget``, which
divides what is left after fixed costs by ``DefaultPoolConfigurator``'s cell size). The plugin's
hooks on those classes (from ``sglang_m3.plugin.HOOKS``, applied here with SGLang's own wrapper)
must make the pool it then allocates fit the budget: the oracle is the bytes the real offload pool
holds in device buffers (the dense layers' K/V, the index keys, the block caches; the sparse layers'
K/V live in the host store), built at the size SGLang chose. M3's published geometry at attention
TP8 (one KV head per rank), bf16, MSA blocks of 128.
"""

from __future__ import annotations

import json
import types

import pytest
import torch
from sglang.srt.plugins.hook_registry import HookType, _wrap_fn

from sglang_m3.cache.offload_block_cache import SparseBlockCache, block_cache_bytes, block_cache_fixed_bytes
from sglang_m3.cache.offload_pool import offload_pool_class
from sglang_m3.cache.offload_settings import OffloadShape
from sglang_m3.integration.hooks import reserve_block_caches, spec_of
from sglang_m3.plugin import HOOKS
from sglang_m3.recipe.render import SPARSE_OFFLOAD_BLOCKS_ENV
from tests.recipe.test_fit_matches_sglang import m3_config

pool_configurator = pytest.importorskip("sglang.srt.model_executor.pool_configurator")
kv_cache_configurator = pytest.importorskip("sglang.srt.mem_cache.kv_cache_configurator")

ATTN_TP, PAGE, CACHE_BLOCKS = 8, 128, 16  # 16 entries: one decode token's top-16 of one KV head
BUDGET_BYTES = 160 * 2**20
#: the classes whose methods the plugin hooks for pool sizing, by the prefix of their hook targets
HOOKED_CLASSES = {
    "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator.": pool_configurator.DefaultPoolConfigurator,
    "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator.": kv_cache_configurator.KVCacheConfigurator,
}


@pytest.fixture(scope="module")
def model_config(tmp_path_factory):
    from sglang.srt.configs.model_config import ModelConfig

    directory = tmp_path_factory.mktemp("m3-config")
    (directory / "config.json").write_text(json.dumps(m3_config()))
    return ModelConfig(str(directory), trust_remote_code=False, dtype="bfloat16")


@pytest.fixture
def sglang_runtime(monkeypatch):
    """The runtime facts SGLang's pool sizing reads (one rank of attention TP8, nothing else on), and
    the plugin's hooks on the sizing classes installed as SGLang installs them."""
    import sglang.srt.layers.cp.utils as cp_utils
    import sglang.srt.mem_cache.page_interleave as page_interleave
    import sglang.srt.runtime_context as runtime_context
    import sglang.srt.server_args as server_args

    from sglang_m3.integration.hooks import upstream_minimax_sparse_wiring_off

    parallel = types.SimpleNamespace(attn_tp_size=ATTN_TP, attn_dcp_size=1, attn_cp_size=1, pp_size=1,
                                     enable_dsa_cache_layer_split=False, enable_kv_cache_sharding=False)
    schedule = types.SimpleNamespace(max_total_tokens=None, page_size=PAGE)
    memory = types.SimpleNamespace(enable_hisparse=False, enable_unified_memory=False)
    for module in (pool_configurator, kv_cache_configurator, cp_utils, page_interleave, runtime_context):
        monkeypatch.setattr(module, "get_parallel", lambda: parallel, raising=False)
    for module in (pool_configurator, kv_cache_configurator, runtime_context):
        monkeypatch.setattr(module, "get_schedule", lambda: schedule, raising=False)
        monkeypatch.setattr(module, "get_memory", lambda: memory, raising=False)
    monkeypatch.setattr(pool_configurator, "resolving_view", lambda view: view)
    monkeypatch.setattr(server_args, "m3_fp8_attn_gemm_enabled", lambda view: False)
    # served through the plugin, M3 takes SGLang's MHA sizing, as the plugin turns this off
    monkeypatch.setattr(pool_configurator, "is_minimax_sparse", upstream_minimax_sparse_wiring_off)
    for hook in HOOKS:
        for prefix, owner in HOOKED_CLASSES.items():
            if hook.target.startswith(prefix):
                name = hook.target.removeprefix(prefix)
                monkeypatch.setattr(owner, name, _wrap_fn(getattr(owner, name), hook.function, HookType[hook.kind]))


def kv_configurator(model_config):
    """SGLang's ``KVCacheConfigurator`` with the fields pool sizing reads, for one TP rank of M3."""
    layers = model_config.num_hidden_layers
    kvc = object.__new__(kv_cache_configurator.KVCacheConfigurator)  # a slots dataclass: fields set one by one
    fields = dict(
        model_config=model_config, kv_cache_dtype=torch.bfloat16, kv_cache_dtype_str="auto", model_dtype=torch.bfloat16,
        layer_info=types.SimpleNamespace(start_layer=0, end_layer=layers, num_effective_layers=layers),
        server_args=types.SimpleNamespace(enable_hisparse=False), use_mla_backend=False, is_draft_worker=False,
        is_hybrid_swa=False, pp_size=1, page_size=PAGE, post_capture_kv_active=False,
        spec_algorithm=types.SimpleNamespace(is_eagle=lambda: False, is_standalone=lambda: False,
                                             is_dflash_family=lambda: False))
    for name, value in fields.items():
        setattr(kvc, name, value)
    return kvc


def device_bytes(pool) -> int:
    """Bytes the pool holds outside its host store: every buffer it allocated on the device."""
    offloaded = pool._offloaded_local_layers()
    kv = sum(pool.k_buffer[i].nbytes + pool.v_buffer[i].nbytes for i in range(pool.layer_num) if i not in offloaded)
    caches = sum(tensor.nbytes for cache in pool.block_caches.values() for tensor in vars(cache).values()
                 if isinstance(tensor, torch.Tensor))
    return kv + pool.index_k_size_bytes() + caches


def offload_pool(model_config, tokens):
    """The offload pool SGLang builds for one TP8 rank of M3 at ``tokens`` slots (CPU tensors)."""
    spec = spec_of(model_config)
    shape = OffloadShape(cache_blocks=CACHE_BLOCKS, block_size=PAGE, topk=spec.index_topk_blocks, kv_heads=1,
                         max_query_tokens=1)
    return offload_pool_class(spec, torch.bfloat16, shape)(
        size=tokens, page_size=PAGE, dtype=torch.bfloat16, head_num=1, head_dim=spec.head_dim,
        layer_num=model_config.num_hidden_layers, device="cpu", enable_memory_saver=False)


def test_the_pool_sglang_sizes_under_offload_fits_its_budget(sglang_runtime, model_config, monkeypatch):
    monkeypatch.setenv(SPARSE_OFFLOAD_BLOCKS_ENV, str(CACHE_BLOCKS))
    kvc = kv_configurator(model_config)
    tokens = kvc.config_from_budget(BUDGET_BYTES).max_total_num_tokens
    cell = pool_configurator.DefaultPoolConfigurator(kvc)._cell_size
    used = device_bytes(offload_pool(model_config, tokens))
    # SGLang also allocates one padding page it does not charge (its MHA sizing does the same)
    padding_page = PAGE * cell
    assert used <= BUDGET_BYTES + padding_page, (
        f"a pool of {tokens} tokens holds {used:,} device bytes, {used - BUDGET_BYTES:,} more than the "
        f"{BUDGET_BYTES:,} it was sized for")
    # and nothing is charged twice: the pool uses the budget up to SGLang's rounding to whole pages
    assert used >= BUDGET_BYTES - 2 * padding_page


@pytest.mark.parametrize("budget_mib", [160, 161, 600])
def test_the_budget_gives_the_block_caches_exactly_what_they_allocate(sglang_runtime, model_config, monkeypatch,
                                                                      budget_mib):
    """What comes off the KV budget is the caches' whole allocation on CPU tensors: entries, scratch entry,
    entry tables and counters, and the page table of the very pool sized beside them (it grows with it)."""
    monkeypatch.setenv(SPARSE_OFFLOAD_BLOCKS_ENV, str(CACHE_BLOCKS))
    sglang_sizing = kv_cache_configurator.KVCacheConfigurator.config_from_budget.__wrapped__  # without the reserve
    budgets = []

    def recorded_sizing(kvc, budget_bytes, *, cap_tokens=None):
        budgets.append(budget_bytes)
        return sglang_sizing(kvc, budget_bytes, cap_tokens=cap_tokens)

    budget = budget_mib * 2**20
    tokens = reserve_block_caches(recorded_sizing, kv_configurator(model_config), budget).max_total_num_tokens
    pool = offload_pool(model_config, tokens)
    allocated = sum(cache.device_bytes() for cache in pool.block_caches.values())
    assert budget - budgets[-1] == allocated  # the sizing whose pool the hook returns


def test_post_capture_kv_sizing_under_offload_is_refused_naming_both(sglang_runtime, model_config, monkeypatch):
    """SGLang's post-capture resize sizes the pool a second time from the memory left after capture,
    with the block caches already allocated: the reserve would take them off twice, and the pool it
    builds backs every layer's K/V on the device, where sparse offload keeps the sparse layers' in
    the host store."""
    monkeypatch.setenv(SPARSE_OFFLOAD_BLOCKS_ENV, str(CACHE_BLOCKS))
    kvc = kv_configurator(model_config)
    kvc.post_capture_kv_active = True
    with pytest.raises(ValueError, match=f"^{SPARSE_OFFLOAD_BLOCKS_ENV}={CACHE_BLOCKS} cannot run with "
                                         "SGLANG_ENABLE_POST_CAPTURE_KV_SIZING=1: .* unset one of them$"):
        kvc.config_from_budget(BUDGET_BYTES)
    monkeypatch.delenv(SPARSE_OFFLOAD_BLOCKS_ENV)
    assert kvc.config_from_budget(BUDGET_BYTES).max_total_num_tokens > 0  # without offload: no block caches to count


def test_block_caches_larger_than_the_budget_are_refused_by_name(sglang_runtime, model_config, monkeypatch):
    monkeypatch.setenv(SPARSE_OFFLOAD_BLOCKS_ENV, "4096")  # 57 layers x 4,097 entries x 64 KiB, and their tables
    with pytest.raises(ValueError, match=f"^{SPARSE_OFFLOAD_BLOCKS_ENV}=4096: the block caches take 15.308 GB of "
                                         "device memory, the whole KV budget of 0.168 GB; lower "
                                         f"{SPARSE_OFFLOAD_BLOCKS_ENV} or raise --mem-fraction-static$"):
        kv_configurator(model_config).config_from_budget(BUDGET_BYTES)


def test_without_offload_the_whole_budget_goes_to_the_pool(sglang_runtime, model_config, monkeypatch):
    monkeypatch.delenv(SPARSE_OFFLOAD_BLOCKS_ENV, raising=False)
    kvc = kv_configurator(model_config)
    cell = pool_configurator.DefaultPoolConfigurator(kvc)._cell_size
    assert kvc.config_from_budget(BUDGET_BYTES).max_total_num_tokens == BUDGET_BYTES // cell // PAGE * PAGE


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float8_e4m3fn], ids=str)
def test_the_offload_pool_reports_its_device_bytes_as_the_kv_cache_size(kv_dtype):
    """SGLang logs ``get_kv_size_bytes`` as the KV cache and reports it (``mem_usage``, GB) in its
    metrics and server state: device memory, so without the host store and with the block caches."""
    spec = types.SimpleNamespace(sparse_layer_ids=(1, 2), index_head_dim=8, index_block_size=4, index_topk_blocks=2)
    shape = OffloadShape(cache_blocks=8, block_size=4, topk=2, kv_heads=2, max_query_tokens=1)
    pool = offload_pool_class(spec, torch.float32, shape)(
        size=256, page_size=4, dtype=kv_dtype, head_num=2, head_dim=8, layer_num=3, device="cpu",
        enable_memory_saver=False)
    k_bytes, v_bytes = pool.get_kv_size_bytes()
    assert k_bytes + v_bytes == device_bytes(pool)
    assert pool.mem_usage == pytest.approx(device_bytes(pool) / 2**30)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8], ids=str)
@pytest.mark.parametrize("entries, heads", [(1, 1), (16, 2), (40, 4)])
def test_fixed_bytes_are_what_a_block_cache_allocates_besides_its_page_table(dtype, entries, heads):
    pages = 37
    cache = SparseBlockCache(entries, pages, 16, heads, 8, 8, dtype, "cpu")
    allocated = sum(tensor.nbytes for tensor in vars(cache).values() if isinstance(tensor, torch.Tensor))
    page_table = cache.page_entry.nbytes  # the one part that grows with the slot pool: 8 bytes a page
    assert page_table == 8 * (pages + 1)
    assert block_cache_fixed_bytes(entries, 16, heads, 8, 8, dtype.itemsize) == allocated - page_table
    assert block_cache_bytes(entries, pages, 16, heads, 8, 8, dtype.itemsize) == allocated == cache.device_bytes()
