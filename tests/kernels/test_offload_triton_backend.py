"""Sparse offload's CUDA path, on the CPU under the Triton interpreter: bit for bit the Triton backend.

Two pools receive the same K/V and index keys through their backends: the index-key pool with
``MSATritonBackend`` (every K/V in device buffers), and the offload pool on its kernel path
(``kernel_copies``: writes by ``store_rows``, fetches by ``gather_pages``, extend batches through
a staging buffer) with ``MSAOffloadTritonBackend``, whose block caches are far smaller than the
requests' blocks. Prompts are prefilled in chunks that end mid-block, one request reuses another's
first pages (a radix hit: the same slots), then the batch decodes or verifies chains step after
step, eagerly or through the static CUDA-graph plans (capture once, then replays with the batch
padded to the captured size), so the caches evict, hit shared pages and serve the block being
written. Outputs are compared with ``torch.equal``.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
import torch
from forward_batch_doubles import forward_batch_for
from offload_helpers import PagedRequests

from sglang_m3.cache.index_kv_pool import indexed_pool_class
from sglang_m3.cache.offload_pool import M3SparseOffloadKVPool, offload_pool_class
from sglang_m3.cache.offload_settings import OffloadShape

LAYERS, SPARSE, HQ, HKV, D, DI, BLOCK, TOPK = 3, (1, 2), 4, 2, 32, 32, 16, 2
SIZE = 48 * BLOCK
WIDTH = 96  # req_to_token columns (context 88: 6 blocks, as graph plans are sized)
SPEC = SimpleNamespace(sparse_layer_ids=SPARSE, index_head_dim=DI, index_block_size=BLOCK, index_topk_blocks=TOPK,
                       index_local_blocks=1, index_init_blocks=0)
MAX_BS = 4


@pytest.fixture(scope="module")
def modules(backend_module):
    """The interpreted kernels under the offload pool's block cache and the offload backend."""
    from triton.runtime.interpreter import InterpretedFunction

    from msa_kernels import triton_offload
    from sglang_m3.cache import offload_block_cache
    from sglang_m3.msa import offload_triton_backend

    if not isinstance(triton_offload.gather_pages_kernel, InterpretedFunction):
        importlib.reload(triton_offload)
        importlib.reload(offload_block_cache)
    return backend_module, importlib.reload(offload_triton_backend)


@pytest.fixture(autouse=True)
def sparse_kernels_for_every_extend(monkeypatch):
    # The Triton backend may attend short extends densely (SDPA) where MSA selects every block;
    # the offload path always runs the MSA kernels: compare kernel to kernel.
    monkeypatch.setenv("SGLANG_M3_FULL_SELECTION_DENSE", "0")


def make_pool(pool_class):
    return pool_class(size=SIZE, page_size=BLOCK, dtype=torch.float32, head_num=HKV, head_dim=D, layer_num=LAYERS,
                      device="cpu", enable_memory_saver=False)


def kernel_pool_class(shape):
    """The offload pool on its CUDA path (kernel copies), here on CPU tensors."""
    return type("KernelOffloadPool", (offload_pool_class(SPEC, torch.float32, shape),), {"kernel_copies": True})


def layer(layer_id):
    return SimpleNamespace(layer_id=layer_id, tp_q_head_num=HQ, tp_k_head_num=HKV, qk_head_dim=D, v_head_dim=D,
                           scaling=D**-0.5, k_scale=None, v_scale=None)


def runner(pool, req_to_token):
    return SimpleNamespace(req_to_token_pool=SimpleNamespace(req_to_token=req_to_token), token_to_kv_pool=pool,
                           device="cpu", page_size=BLOCK, model_config=SimpleNamespace(context_len=WIDTH - 8))


def paged_requests(shared_pages, generator):
    """Three requests over the pool; row 3 stays the padding row graph batches point at."""
    return PagedRequests(SIZE, BLOCK, WIDTH, shared_pages, generator, rows=3, spare_rows=1)


def random_layer_inputs(rows, generator):
    q, k, v = (torch.randn(rows, HQ if i == 0 else HKV, D, generator=generator) for i in range(3))
    return q, k, v, torch.randn(rows, HKV, DI, generator=generator), torch.randn(rows, DI, generator=generator)


def forward_layers(backend, fb, mode, inputs):
    forward = backend.forward_extend if mode == "EXTEND" else backend.forward_decode
    return [forward(q.view(q.shape[0], -1), k.clone(), v.clone(), layer(layer_id), fb, index_q=iq, index_k=ik)
            for layer_id, (q, k, v, iq, ik) in zip(SPARSE, inputs)]


class GraphDriver:
    """SGLang's decode / verify graph runner around the offload backend: static input buffers
    padded to ``MAX_BS`` with pool row ``pad_row`` and seq_len ``fill``, out-of-graph metadata
    (capture once), in-graph metadata and the forward at every step."""

    def __init__(self, backend, q_len: int, pad_row: int, fill: int = 1):
        self.backend, self.q_len, self.pad_row, self.fill = backend, q_len, pad_row, fill
        backend.init_cuda_graph_state(MAX_BS, MAX_BS * q_len)
        self.captured = False

    def run(self, fb, mode, inputs, generator):
        real = fb.req_pool_indices.shape[0]
        pad = MAX_BS - real
        q_len = self.q_len
        padded = SimpleNamespace(
            forward_mode=fb.forward_mode, batch_size=MAX_BS, spec_info=fb.spec_info,
            req_pool_indices=torch.cat([fb.req_pool_indices, torch.full((pad,), self.pad_row)]),
            seq_lens=torch.cat([fb.seq_lens, torch.full((pad,), self.fill)]),
            seq_lens_cpu=torch.cat([fb.seq_lens_cpu, torch.full((pad,), self.fill)]),
            out_cache_loc=torch.cat([fb.out_cache_loc, torch.zeros(pad * q_len, dtype=torch.int64)]),
        )
        self.backend.init_forward_metadata_out_graph(padded, in_capture=not self.captured)
        self.captured = True
        self.backend.init_forward_metadata_in_graph(padded)
        extra = pad * q_len
        padded_inputs = [tuple(torch.cat([x, torch.randn(extra, *x.shape[1:], generator=generator)]) for x in group)
                         for group in inputs]
        outs = forward_layers(self.backend, padded, mode, padded_inputs)
        return [out[: real * q_len] for out in outs]


@pytest.mark.parametrize(
    "cache_blocks, q_len, graphs",
    [(4, 1, False), (8, 2, False), (9, 1, True), (8, 2, True)],
    ids=["one-request-rounds", "verify-chains", "graphs-two-request-rounds", "graphs-verify-chains"],
)
def test_offload_path_equals_the_triton_backend(modules, cache_blocks, q_len, graphs):
    backend_module, offload_module = modules
    generator = torch.Generator().manual_seed(cache_blocks + 10 * graphs)
    shape = OffloadShape(cache_blocks=cache_blocks, block_size=BLOCK, topk=TOPK, kv_heads=HKV, max_query_tokens=q_len)
    pools = {"device": make_pool(indexed_pool_class(SPEC, torch.float32)), "offload": make_pool(kernel_pool_class(shape))}
    assert pools["offload"].uses_kernels
    paged = paged_requests(shared_pages=2, generator=generator)
    backends = {"device": backend_module.MSATritonBackend(runner(pools["device"], paged.req_to_token), SPEC),
                "offload": offload_module.MSAOffloadTritonBackend(runner(pools["offload"], paged.req_to_token), SPEC)}
    if graphs:
        graphs = {name: GraphDriver(backend, q_len, pad_row=3) for name, backend in backends.items()}

    # prefill in chunks ending mid-block; request 1 reuses request 0's first 2 pages (a radix hit)
    for req, chunks in ((0, (20, 29)), (1, (21,)), (2, (9, 30))):
        for i, chunk in enumerate(chunks):
            if req == 1 and i == 0:
                paged.lens[1] = 32  # the shared prefix is cached already
            paged.grow(req, chunk)
            fb = forward_batch_for("EXTEND", paged.req_to_token, torch.tensor([req]), [paged.lens[req]], [chunk])
            inputs = [random_layer_inputs(chunk, generator) for _ in SPARSE]
            outs = {}
            for name, backend in backends.items():
                backend.init_forward_metadata(fb)
                outs[name] = forward_layers(backend, fb, "EXTEND", inputs)
            for a, b in zip(outs["device"], outs["offload"]):
                assert torch.equal(a, b)
    assert pools["offload"].staged_bytes > 0

    mode = "DECODE" if q_len == 1 else "TARGET_VERIFY"
    for _ in range(3):
        for req in range(3):
            paged.grow(req, q_len)
        fb = forward_batch_for(mode, paged.req_to_token, torch.tensor([0, 1, 2]), paged.lens, [q_len] * 3)
        inputs = [random_layer_inputs(3 * q_len, generator) for _ in SPARSE]
        if not graphs:
            backends["device"].init_forward_metadata(fb)
            want = forward_layers(backends["device"], fb, mode, inputs)
            backends["offload"].init_forward_metadata(fb)
            got = forward_layers(backends["offload"], fb, mode, inputs)
        else:  # both through their static graph plans (graph and eager plans may split differently), same padding rows
            seed = int(torch.randint(1 << 30, (1,), generator=generator))
            want = graphs["device"].run(fb, mode, inputs, torch.Generator().manual_seed(seed))
            got = graphs["offload"].run(fb, mode, inputs, torch.Generator().manual_seed(seed))
        for a, b in zip(want, got):
            assert torch.equal(a, b)

    offload = pools["offload"]
    counters = offload.offload_counters()
    assert counters["misses"] > 0 and counters["h2d_bytes"] == counters["misses"] * BLOCK * HKV * 2 * D * 4
    if shape.requests_per_round > 1:
        assert counters["hits"] > 0
    for layer_id in SPARSE:
        cache = offload.block_cache(layer_id)
        assert int((cache.page_entry[: cache.num_pages] >= 0).sum()) <= cache_blocks
        # every resident entry holds exactly its page of the host store (write-through kept it fresh)
        host_k, host_v = offload.host_kv(layer_id)
        for page in torch.nonzero(cache.page_entry[: cache.num_pages] >= 0).flatten().tolist():
            entry = int(cache.page_entry[page])
            assert torch.equal(cache.k_pages[entry], cache.as_pages(host_k)[page])
            assert torch.equal(cache.v_pages[entry], cache.as_pages(host_v)[page])
    # the other layer (dense) and the index keys stay in device buffers, identical in both pools
    # (past the padding page, which padded graph rows write)
    device = pools["device"]
    assert torch.equal(device.get_key_buffer(0), offload.get_key_buffer(0))
    for layer_id in SPARSE:
        assert torch.equal(device.get_index_k_buffer(layer_id)[BLOCK:], offload.get_index_k_buffer(layer_id)[BLOCK:])
        assert torch.equal(device.get_key_buffer(layer_id)[BLOCK:], offload.host_kv(layer_id)[0][BLOCK:])


def test_the_backend_counts_steps_out_of_the_graph_and_logs_totals(modules, monkeypatch, caplog):
    backend_module, offload_module = modules
    monkeypatch.setenv("SGLANG_M3_SPARSE_OFFLOAD_LOG_STEPS", "2")
    shape = OffloadShape(cache_blocks=8, block_size=BLOCK, topk=TOPK, kv_heads=HKV, max_query_tokens=1)
    pool = make_pool(kernel_pool_class(shape))
    paged = paged_requests(shared_pages=0, generator=torch.Generator().manual_seed(0))
    backend = offload_module.MSAOffloadTritonBackend(runner(pool, paged.req_to_token), SPEC)
    paged.grow(0, 20)
    generator = torch.Generator().manual_seed(1)
    fb = forward_batch_for("EXTEND", paged.req_to_token, torch.tensor([0]), [20], [20])
    backend.init_forward_metadata(fb)
    forward_layers(backend, fb, "EXTEND", [random_layer_inputs(20, generator) for _ in SPARSE])
    graph = GraphDriver(backend, 1, pad_row=3)
    with caplog.at_level("INFO", logger="sglang_m3.msa.offload_backend"):
        for _ in range(4):  # the capture does not count; replays 1-3 are steps (the log comes before step 3)
            paged.grow(0, 1)
            fb = forward_batch_for("DECODE", paged.req_to_token, torch.tensor([0]), [paged.lens[0]], [1])
            graph.run(fb, "DECODE", [random_layer_inputs(1, generator) for _ in SPARSE], generator)
    lines = [r.getMessage() for r in caplog.records if "M3 sparse offload after" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("M3 sparse offload after 2 decode/verify steps")
    assert "extend staging" in lines[0]


def test_dense_layers_keep_sglangs_backend_under_offload_whatever_the_switch(modules, monkeypatch):
    backend_module, offload_module = modules
    monkeypatch.setenv("SGLANG_M3_DENSE_VERIFY", "msa")
    shape = OffloadShape(cache_blocks=8, block_size=BLOCK, topk=TOPK, kv_heads=HKV, max_query_tokens=4)
    paged = paged_requests(shared_pages=0, generator=torch.Generator().manual_seed(0))
    backend = offload_module.MSAOffloadTritonBackend(runner(make_pool(kernel_pool_class(shape)), paged.req_to_token), SPEC)
    paged.grow(0, 40)
    fb = forward_batch_for("TARGET_VERIFY", paged.req_to_token, torch.tensor([0]), [40], [4])
    backend.init_forward_metadata(fb)
    layer = SimpleNamespace(layer_id=0, tp_k_head_num=HKV, logit_cap=0)
    assert not backend.takes_dense_layer(layer, fb, {})


def test_draft_trees_and_torch_pools_are_refused(modules):
    backend_module, offload_module = modules
    shape = OffloadShape(cache_blocks=8, block_size=BLOCK, topk=TOPK, kv_heads=HKV, max_query_tokens=1)
    paged = paged_requests(shared_pages=0, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="needs the pool's kernel copies"):
        offload_module.MSAOffloadTritonBackend(runner(make_pool(offload_pool_class(SPEC, torch.float32, shape)),
                                                      paged.req_to_token), SPEC)
    with pytest.raises(TypeError, match="needs the M3 offload KV pool"):
        offload_module.MSAOffloadTritonBackend(runner(make_pool(indexed_pool_class(SPEC, torch.float32)),
                                                      paged.req_to_token), SPEC)
    backend = offload_module.MSAOffloadTritonBackend(runner(make_pool(kernel_pool_class(shape)), paged.req_to_token), SPEC)
    paged.grow(0, 40)
    fb = forward_batch_for("TARGET_VERIFY", paged.req_to_token, torch.tensor([0]), [40], [4])
    fb.spec_info.topk = 2
    fb.spec_info.custom_mask = torch.ones(4 * 40, dtype=torch.bool)
    with pytest.raises(ValueError, match="draft trees are not verified under sparse offload"):
        backend.init_forward_metadata(fb)


def test_hook_picks_the_backend_by_the_pools_copy_path(modules):
    from sglang_m3.integration.hooks import _sparse_backend
    from sglang_m3.msa.offload_backend import MSAOffloadTorchBackend

    _, offload_module = modules
    shape = OffloadShape(cache_blocks=8, block_size=BLOCK, topk=TOPK, kv_heads=HKV, max_query_tokens=1)
    req_to_token = torch.zeros(2, WIDTH, dtype=torch.int64)
    kernel_pool, torch_pool = make_pool(kernel_pool_class(shape)), make_pool(offload_pool_class(SPEC, torch.float32, shape))
    assert isinstance(kernel_pool, M3SparseOffloadKVPool) and not torch_pool.uses_kernels
    assert type(_sparse_backend(runner(kernel_pool, req_to_token), SPEC)).__name__ == "MSAOffloadTritonBackend"
    assert type(_sparse_backend(runner(torch_pool, req_to_token), SPEC)) is MSAOffloadTorchBackend


def test_staging_layout_packs_each_requests_blocks(modules):
    _, offload_module = modules
    table = torch.tensor([[5, 9, 2, 0], [5, 7, 0, 0]], dtype=torch.int32)  # request 1 shares page 5
    staging = offload_module.plan_staging(table, [40, 17], 16)  # 3 blocks, then 2
    assert staging.pages == 5
    assert staging.src_pages.tolist() == [5, 9, 2, 5, 7]
    assert staging.page_table.tolist() == [[0, 1, 2, 0], [3, 4, 0, 0]]
    selected = torch.tensor([[[0, 2], [1, -1]], [[1, 0], [-1, -1]]], dtype=torch.int32)  # [2 rows, 2 heads, top-2]
    assert offload_module.round_pages(table, selected).tolist() == [5, 2, 9, -1, 7, 5, -1, -1]
