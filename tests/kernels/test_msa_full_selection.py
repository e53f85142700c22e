"""``MSATritonBackend``'s dense path for extend requests that select every block, on the CPU.

The kernels run under the Triton interpreter and SDPA on the CPU, so the split itself is what is
tested: a batch mixing requests within the limit (``topk * block`` = 64 tokens here: fresh, a
chunk after a prefix, the limit exactly) and beyond it (the 65th token, a long prefix) gives the
same outputs and the same caches (K, V and index keys) with the dense path on and off, both
equal to the reference MSA; an all-dense batch plans no kernels; decode batches never take it.
"""

from types import SimpleNamespace

import pytest
import torch

from msa_kernels.paged_batch import make_paged_batch, reference_request
from msa_kernels.plan import DecodePlan, PrefillPlan
from msa_triton_fakes import BLOCK, D, HKV, HQ, LAYER, PARAMS, SPEC, forward_batch
from sglang_m3.msa.full_selection import ENV

# dense: 40 fresh, 64 (16 after a 48 prefix), 20 fresh, 1; sparse: 65 (17 after 48), 110 (30 after 80)
KV_LENS, EXTEND_LENS = [40, 65, 64, 110, 20, 1], [40, 17, 16, 30, 20, 1]
DENSE, SPARSE = [0, 2, 4, 5], [1, 3]


class _Pool:
    """SGLang's pool surface over slot-indexed caches that start as NaN at the new tokens' slots."""

    head_num = HKV

    def __init__(self, batch, new_slots):
        self.k, self.v, self.ik = (x.clone() for x in (batch.k_cache, batch.v_cache, batch.ik_cache))
        for cache in (self.k, self.v, self.ik):
            cache[new_slots] = float("nan")

    def set_kv_buffer(self, layer, write, k, v):
        self.k[write.loc] = k.reshape(-1, HKV, D).to(self.k.dtype)
        self.v[write.loc] = v.reshape(-1, HKV, D).to(self.v.dtype)

    def set_index_k(self, layer_id, loc, index_k):
        self.ik[loc] = index_k.reshape(self.ik[loc].shape)

    def get_key_buffer(self, layer_id):
        return self.k

    def get_value_buffer(self, layer_id):
        return self.v

    def get_index_k_buffer(self, layer_id):
        return self.ik


def _backend(module, batch, pool):
    runner = SimpleNamespace(
        req_to_token_pool=SimpleNamespace(req_to_token=batch.req_to_token.flip(0)),
        token_to_kv_pool=pool,
        device="cpu",
        page_size=BLOCK,
        model_config=SimpleNamespace(context_len=batch.req_to_token.shape[1]),
    )
    return module.MSATritonBackend(runner, SPEC)


def _serve_extend(module, batch, monkeypatch, switch):
    """One sparse layer's forward_extend over ``batch`` with the dense path ``switch`` ("1"/"0")."""
    monkeypatch.setenv(ENV, switch)
    fb = forward_batch("EXTEND", batch)
    pool = _Pool(batch, fb.out_cache_loc)
    backend = _backend(module, batch, pool)
    backend.init_forward_metadata(fb)
    loc = fb.out_cache_loc
    k, v, index_k = batch.k_cache[loc], batch.v_cache[loc], batch.ik_cache[loc, 0]
    rows = batch.q.shape[0]
    out = backend.forward_extend(batch.q.reshape(rows, -1), k.reshape(rows, -1), v.reshape(rows, -1), LAYER, fb,
                                 index_q=batch.iq, index_k=index_k)
    return backend, pool, out.view(rows, HQ, D)


def _batch(kv_lens, extend_lens, seed):
    return make_paged_batch(kv_lens, extend_lens, HQ, HKV, D, D, BLOCK, torch.float32, "cpu",
                            generator=torch.Generator().manual_seed(seed))


def test_mixed_batch_dense_path_on_and_off_agree_with_each_other_and_the_reference(backend_module, monkeypatch):
    batch = _batch(KV_LENS, EXTEND_LENS, seed=11)
    on_backend, on_pool, on = _serve_extend(backend_module, batch, monkeypatch, "1")
    off_backend, off_pool, off = _serve_extend(backend_module, batch, monkeypatch, "0")

    plan = on_backend.full_selection
    assert [s.q_len for s in plan.spans] == [EXTEND_LENS[b] for b in DENSE]
    assert plan.sparse == tuple(SPARSE)
    assert isinstance(on_backend.kernel_plan, PrefillPlan)
    assert on_backend.kernel_plan.num_tokens == sum(EXTEND_LENS[b] for b in SPARSE)
    assert off_backend.full_selection is None
    assert off_backend.kernel_plan.num_tokens == sum(EXTEND_LENS)

    for name in ("k", "v", "ik"):  # the same cache writes, index keys included, and nothing else
        torch.testing.assert_close(getattr(on_pool, name), getattr(off_pool, name), rtol=0, atol=0, equal_nan=True)
    for b, kv in enumerate(KV_LENS):  # every request's index keys are there for later decode steps
        assert not on_pool.ik[batch.req_to_token[b, :kv].long()].isnan().any()
    torch.testing.assert_close(on, off, rtol=1e-5, atol=1e-5)
    for b in range(len(KV_LENS)):
        want, _, _ = reference_request(batch, b, PARAMS)
        torch.testing.assert_close(on[batch.rows_of(b)], want, rtol=1e-4, atol=1e-4)


def test_all_dense_batch_plans_no_kernels(backend_module, monkeypatch):
    kv_lens, extend_lens = [64, 33, 50], [64, 3, 50]
    batch = _batch(kv_lens, extend_lens, seed=5)
    backend, pool, out = _serve_extend(backend_module, batch, monkeypatch, "1")
    assert backend.kernel_plan is None and backend.full_selection.sparse_rows is None
    assert not out.isnan().any()
    for b in range(len(kv_lens)):
        want, _, _ = reference_request(batch, b, PARAMS)
        torch.testing.assert_close(out[batch.rows_of(b)], want, rtol=1e-4, atol=1e-4)


def test_fp8_kv_cache_with_scales_reads_what_the_kernels_read(backend_module, monkeypatch):
    """Dense requests read the cached fp8 values times the layer's scales, as the sparse kernels do."""
    monkeypatch.setenv(ENV, "1")
    batch = _batch([40, 90], [8, 10], seed=2).with_fp8_kv(k_scale=0.37, v_scale=1.9)
    runner_pool = SimpleNamespace(
        head_num=HKV, get_key_buffer=lambda i: batch.k_cache, get_value_buffer=lambda i: batch.v_cache,
        get_index_k_buffer=lambda i: batch.ik_cache,
    )
    backend = _backend(backend_module, batch, runner_pool)
    backend.init_forward_metadata(forward_batch("EXTEND", batch))
    assert backend.full_selection.sparse == (1,)
    layer = SimpleNamespace(**{**vars(LAYER), "k_scale": torch.tensor(0.37), "v_scale": torch.tensor(1.9),
                               "k_scale_float": 0.37, "v_scale_float": 1.9})
    out = backend._attend(batch.q.reshape(batch.q.shape[0], -1), layer, batch.iq).view(-1, HQ, D)
    for b in range(2):
        want, _, _ = reference_request(batch, b, PARAMS)
        torch.testing.assert_close(out[batch.rows_of(b)], want, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("mode, query_lens", [("DECODE", [1, 1]), ("TARGET_VERIFY", [2, 2])])
def test_decode_and_verify_keep_the_kernels(backend_module, monkeypatch, mode, query_lens):
    monkeypatch.setenv(ENV, "1")
    batch = make_paged_batch([20, 40], query_lens, HQ, HKV, D, D, BLOCK, torch.float32, "cpu", decode_q_len=query_lens[0])
    backend = _backend(backend_module, batch, SimpleNamespace(head_num=HKV))
    backend.init_forward_metadata(forward_batch("EXTEND", _batch([20, 40], [20, 40], seed=1)))
    assert backend.full_selection is not None
    backend.init_forward_metadata(forward_batch(mode, batch))
    assert backend.full_selection is None and isinstance(backend.kernel_plan, DecodePlan)
