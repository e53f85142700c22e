"""The dense layers' SDPA prefill path against attention computed from its definition.

On the CPU, SDPA runs its math kernel, so these tests check what the path itself decides: which
cached tokens each request attends (its prefix gathered through ``req_to_token``, its new tokens
causally, aligned to the last key), GQA grouping, the cache write, and which calls it leaves to
SGLang's backend. The CUDA kernels (cuDNN, FlashAttention) are exercised by the GPU tests.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from attention_definitions import math_attention_with_lse
from forward_batch_doubles import forward_batch_for

from sglang_m3.msa.dense_prefill import CUDNN_SHAPE_STEP, ENV, SDPADensePrefill, sdpa_dense_prefill_enabled

HQ, HKV, D = 6, 2, 8


class _DensePool:
    def __init__(self, k, v):
        self.k, self.v = k, v

    def set_kv_buffer(self, layer, write, k, v):  # cast to the cache's dtype, as SGLang's pool does
        self.k[write.loc] = k.view(-1, HKV, D).to(self.k.dtype)
        self.v[write.loc] = v.view(-1, HKV, D).to(self.v.dtype)

    def get_key_buffer(self, layer_id):
        return self.k

    def get_value_buffer(self, layer_id):
        return self.v


def _layer(**extra):
    return SimpleNamespace(
        layer_id=0, tp_q_head_num=HQ, tp_k_head_num=HKV, qk_head_dim=D, v_head_dim=D, scaling=1 / math.sqrt(D),
        k_scale=None, logit_cap=0.0, sliding_window_size=-1, is_cross_attention=False, **extra,
    )


def _reference(q, keys, values, prefix):
    """Causal GQA attention of ``q`` [n, HQ, D] (positions prefix..) over ``keys`` [prefix + n, HKV, D]."""
    group = HQ // HKV
    out = torch.empty_like(q)
    for j in range(q.shape[0]):
        visible = prefix + j + 1
        for h in range(HQ):
            scores = keys[:visible, h // group] @ q[j, h] / math.sqrt(D)
            out[j, h] = torch.softmax(scores, 0) @ values[:visible, h // group]
    return out


def _setup(kv_lens, extend_lens, seed=0):
    gen = torch.Generator().manual_seed(seed)
    slots = sum(kv_lens) + 5
    req_to_token = torch.zeros(len(kv_lens) + 1, max(kv_lens) + 8, dtype=torch.int64)
    order = (torch.randperm(slots - 1, generator=gen) + 1).tolist()
    start = 0
    for b, n in enumerate(kv_lens):  # request b in pool row b + 1: rows and slots both shuffled
        req_to_token[b + 1, :n] = torch.tensor(order[start : start + n])
        start += n
    fb = forward_batch_for("EXTEND", req_to_token, torch.arange(1, len(kv_lens) + 1), kv_lens, extend_lens)
    k_all, v_all = (torch.randn(slots, HKV, D, generator=gen, dtype=torch.float64) for _ in range(2))
    q = torch.randn(sum(extend_lens), HQ * D, generator=gen, dtype=torch.float64)
    return req_to_token, fb, k_all, v_all, q


@pytest.mark.parametrize(
    "kv_lens, extend_lens",
    [([9], [9]), ([37], [5]), ([40, 23, 17], [17, 23, 1]), ([64, 3], [64, 3])],
    ids=["fresh", "chunk-after-prefix", "mixed", "two-fresh"],
)
def test_matches_causal_attention_over_prefix_and_new_tokens(kv_lens, extend_lens):
    req_to_token, fb, k_all, v_all, q = _setup(kv_lens, extend_lens)
    k_cache, v_cache = k_all.clone(), v_all.clone()
    k_cache[fb.out_cache_loc] = float("nan")  # the new tokens' slots: written by the call itself
    v_cache[fb.out_cache_loc] = float("nan")
    runner = SimpleNamespace(req_to_token_pool=SimpleNamespace(req_to_token=req_to_token), token_to_kv_pool=_DensePool(k_cache, v_cache))
    path = SDPADensePrefill(runner)
    path.plan(fb)
    layer = _layer()
    assert path.takes(fb, layer, {})
    k_new, v_new = k_all[fb.out_cache_loc], v_all[fb.out_cache_loc]
    out = path.forward_extend(q, k_new.reshape(len(q), -1), v_new.reshape(len(q), -1), layer, fb)

    torch.testing.assert_close(k_cache, k_all, rtol=0, atol=0)
    torch.testing.assert_close(v_cache, v_all, rtol=0, atol=0)
    start = 0
    for b, (kv, new) in enumerate(zip(kv_lens, extend_lens)):
        slots = req_to_token[b + 1, :kv]
        expected = _reference(q[start : start + new].view(new, HQ, D), k_all[slots], v_all[slots], kv - new)
        torch.testing.assert_close(out[start : start + new].view(new, HQ, D), expected, rtol=1e-12, atol=1e-12)
        start += new


def test_fp8_cache_prefix_is_read_as_its_e4m3_values():
    """``--kv-cache-dtype fp8_e4m3`` (no KV scales): a chunk after a prefix attends the cached e4m3
    values of every token, widened to the query's dtype (SDPA refuses mixed dtypes)."""
    req_to_token, fb, k_all, v_all, q = _setup([40, 23], [5, 23])
    k_all, v_all, q = k_all.float(), v_all.float(), q.float()
    k_cache, v_cache = k_all.to(torch.float8_e4m3fn), v_all.to(torch.float8_e4m3fn)
    runner = SimpleNamespace(req_to_token_pool=SimpleNamespace(req_to_token=req_to_token), token_to_kv_pool=_DensePool(k_cache, v_cache))
    path = SDPADensePrefill(runner)
    path.plan(fb)
    layer = _layer()
    k_new, v_new = k_all[fb.out_cache_loc], v_all[fb.out_cache_loc]
    out = path.forward_extend(q, k_new.reshape(len(q), -1), v_new.reshape(len(q), -1), layer, fb)
    slots = req_to_token[1, :40]  # the request with a 35-token prefix
    expected = _reference(q[:5].view(5, HQ, D), k_cache[slots].float(), v_cache[slots].float(), 35)
    torch.testing.assert_close(out[:5].view(5, HQ, D), expected, rtol=1e-5, atol=1e-5)
    unrounded = _reference(q[:5].view(5, HQ, D), k_all[slots], v_all[slots], 35)
    assert (out[:5].view(5, HQ, D) - unrounded).abs().max() > 1e-3  # the e4m3 rounding is visible


@pytest.mark.parametrize("mode", ["DECODE", "TARGET_VERIFY"])
def test_graphed_modes_stay_with_sglangs_backend(mode):
    req_to_token, _, _, _, _ = _setup([20, 12], [20, 12])
    fb = forward_batch_for(mode, req_to_token, torch.tensor([1, 2]), [20, 12], [1, 1] if mode == "DECODE" else [3, 3])
    path = SDPADensePrefill(SimpleNamespace(req_to_token_pool=SimpleNamespace(req_to_token=req_to_token), token_to_kv_pool=None))
    path.plan(fb)
    assert not path.takes(fb, _layer(), {})


def test_calls_it_cannot_compute_exactly_stay_with_sglangs_backend():
    req_to_token, fb, *_ = _setup([12], [12])
    path = SDPADensePrefill(SimpleNamespace(req_to_token_pool=SimpleNamespace(req_to_token=req_to_token), token_to_kv_pool=None))
    path.plan(fb)
    assert path.takes(fb, _layer(), {})
    assert not path.takes(fb, _layer(), {"sinks": torch.zeros(HQ)})
    scaled = _layer()
    scaled.k_scale = torch.tensor(0.5)
    assert not path.takes(fb, scaled, {})
    capped = _layer()
    capped.logit_cap = 30.0
    assert not path.takes(fb, capped, {})


def test_enabled_on_cuda_and_the_cpu_and_the_switch_is_checked(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert sdpa_dense_prefill_enabled(torch.device("cuda"))
    assert sdpa_dense_prefill_enabled(torch.device("cpu"))
    assert not sdpa_dense_prefill_enabled(torch.device("meta"))
    monkeypatch.setenv(ENV, "sglang")
    assert not sdpa_dense_prefill_enabled(torch.device("cuda"))
    assert not sdpa_dense_prefill_enabled(torch.device("cpu"))
    monkeypatch.setenv(ENV, "flash")
    with pytest.raises(ValueError, match=ENV):
        sdpa_dense_prefill_enabled(torch.device("cuda"))


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("prefix, n", [(1, 1), (1, 7), (37, 5), (5, 37), (300, 64)])
def test_the_cpus_split_over_its_flash_kernel_is_causal_attention_over_prefix_and_chunk(prefix, n, dtype, tolerance):
    """On the CPU a chunk after a prefix (float32 / bfloat16) takes the split over the CPU's flash
    kernel, GQA heads repeated: the chunk's causal attention over prefix + chunk, to the dtype's
    rounding (float64 keeps the exact masked path: the routing test below)."""
    from sglang_m3.msa import dense_prefill

    gen = torch.Generator().manual_seed(prefix * 100 + n)
    keys, values = (torch.randn(prefix + n, HKV, D, generator=gen, dtype=torch.float64) for _ in range(2))
    q = torch.randn(n, HQ, D, generator=gen, dtype=torch.float64) * 3
    want = _reference(q, keys, values, prefix)
    got = dense_prefill.causal_sdpa(q.to(dtype), keys.to(dtype), values.to(dtype), 1 / math.sqrt(D))
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), want, rtol=tolerance, atol=tolerance)


def test_the_cpus_split_is_for_serving_dtypes_on_the_cpu():
    from sglang_m3.msa.dense_prefill import cpu_split_applies

    assert all(cpu_split_applies(torch.zeros(1, dtype=dtype)) for dtype in (torch.float32, torch.bfloat16, torch.float16))
    assert not cpu_split_applies(torch.zeros(1, dtype=torch.float64))


@pytest.mark.parametrize("prefix, n", [(1, 1), (1, 7), (37, 5), (5, 37), (64, 64)])
def test_prefix_split_merges_to_causal_attention_over_prefix_and_chunk(monkeypatch, prefix, n):
    """The prefix attended unmasked and the chunk causally, merged by their log-sum-exp, is the
    chunk's causal attention over prefix + chunk (the merge checked in float64; the cuDNN call
    itself is checked on the GPU, tests/gpu/test_full_selection_gpu.py)."""
    from sglang_m3.msa import dense_prefill

    monkeypatch.setattr(dense_prefill, "_cudnn_attention_with_lse", math_attention_with_lse)
    gen = torch.Generator().manual_seed(prefix * 100 + n)
    keys, values = (torch.randn(prefix + n, HKV, D, generator=gen, dtype=torch.float64) for _ in range(2))
    q = torch.randn(n, HQ, D, generator=gen, dtype=torch.float64) * 3  # peaked softmax: the merge weights matter
    got = dense_prefill.prefix_split_sdpa(q, keys, values, 1 / math.sqrt(D))
    torch.testing.assert_close(got, _reference(q, keys, values, prefix), rtol=1e-12, atol=1e-12)


def test_prefix_split_switch_is_checked(monkeypatch):
    from sglang_m3.msa.dense_prefill import PREFIX_SPLIT_ENV, prefix_split_applies

    q = torch.zeros(2, HQ, D, dtype=torch.bfloat16)
    assert not prefix_split_applies(q)  # CUDA only
    monkeypatch.setenv(PREFIX_SPLIT_ENV, "yes")
    with pytest.raises(ValueError, match=PREFIX_SPLIT_ENV):
        prefix_split_applies(q)


def test_fused_merge_switch_is_on_by_default_cuda_only_and_checked(monkeypatch):
    from sglang_m3.msa.dense_prefill import FUSED_MERGE_ENV, fused_merge_on, fused_merge_serves

    out = torch.zeros(2, HQ, D, dtype=torch.bfloat16)
    monkeypatch.delenv(FUSED_MERGE_ENV, raising=False)
    assert fused_merge_on()
    assert not fused_merge_serves(out)  # CPU outputs keep the torch ops
    monkeypatch.setenv(FUSED_MERGE_ENV, "0")
    assert not fused_merge_on()
    monkeypatch.setenv(FUSED_MERGE_ENV, "on")
    with pytest.raises(ValueError, match=FUSED_MERGE_ENV):
        fused_merge_serves(out)


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the merge kernel on CPU tensors under the Triton interpreter")
def test_prefix_split_merges_through_the_kernel_where_it_serves(monkeypatch):
    """With the fused merge taking the outputs (forced here on the CPU, where the interpreter runs
    it), the split gives the torch merge's result: bf16 partials of the CPU's flash attention,
    equal up to an exp's last bit (``tests/kernels/test_lse_merge.py`` bounds that)."""
    from sglang_m3.msa import dense_prefill

    gen = torch.Generator().manual_seed(11)
    prefix, n = 40, 24
    keys, values = (torch.randn(prefix + n, HKV, D, generator=gen).to(torch.bfloat16) for _ in range(2))
    q = (torch.randn(n, HQ, D, generator=gen) * 3).to(torch.bfloat16)
    attention = dense_prefill._cpu_flash_attention_with_lse
    want = dense_prefill.prefix_split_sdpa(q, keys, values, 1 / math.sqrt(D), attention=attention)
    merged = []
    real_merge = dense_prefill.merge_by_lse
    monkeypatch.setattr(dense_prefill, "fused_merge_serves", lambda out: True)
    monkeypatch.setattr(dense_prefill, "merge_by_lse", lambda *parts: merged.append(1) or real_merge(*parts))
    got = dense_prefill.prefix_split_sdpa(q, keys, values, 1 / math.sqrt(D), attention=attention)
    assert merged == [1] and got.dtype == torch.bfloat16
    assert (got == want).float().mean() >= 0.99
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=2**-7 * want.float().abs().max().item())


def _routing(monkeypatch, n, length, on_cuda=True):
    """Which path ``causal_sdpa`` takes for ``n`` new tokens over ``length`` keys: ``split`` or the
    first SDPA backend it asks for (the split checks answered as on CUDA in 16-bit, or the CPU)."""
    from sglang_m3.msa import dense_prefill

    asked = []
    monkeypatch.setattr(dense_prefill, "prefix_split_applies", lambda q: on_cuda)
    monkeypatch.setattr(dense_prefill, "cpu_split_applies", lambda q: not on_cuda)
    monkeypatch.setattr(dense_prefill, "prefix_split_sdpa", lambda *args, **kwargs: asked.append("split") or torch.zeros(n, HQ, D))
    real_kernel = dense_prefill.sdpa_kernel

    def recording_kernel(backends):
        asked.append(backends[0].name)
        assert len(set(backends)) == len(backends)
        return real_kernel(backends)

    monkeypatch.setattr(dense_prefill, "sdpa_kernel", recording_kernel)
    keys, values = torch.randn(length, HKV, D), torch.randn(length, HKV, D)
    out = dense_prefill.causal_sdpa(torch.randn(n, HQ, D), keys, values, 0.5)
    assert out.shape == (n, HQ, D)
    return asked[0]


@pytest.mark.parametrize("n, length, path", [
    (8192, 8192, "CUDNN_ATTENTION"),  # a first chunk of a long prompt
    (1024, 1024, "CUDNN_ATTENTION"),
    (2000, 2000, "FLASH_ATTENTION"),  # a short prompt of any length: no plan to build
    (1, 1, "FLASH_ATTENTION"),
    (8192, 3 * 8192, "split"),  # a full chunk after full chunks
    (1024, 5 * 1024, "split"),
    (8192, 8192 + 5000, "FLASH_ATTENTION"),  # after a radix hit of odd length
    (5000, 8192 + 5000, "FLASH_ATTENTION"),  # a prompt's last, partial chunk
])
def test_cudnn_takes_only_shapes_that_recur(monkeypatch, n, length, path):
    """cuDNN builds a plan per new shape (50-80 ms of host on an H100): only step-aligned shapes,
    which recur under chunked prefill, go to it; the choice is the shape's alone."""
    assert _routing(monkeypatch, n, length) == path
    assert _routing(monkeypatch, n, length) == path  # the same again: no history


def test_cudnn_switch_always_takes_every_shape_and_is_checked(monkeypatch):
    from sglang_m3.msa.dense_prefill import CUDNN_ENV

    monkeypatch.setenv(CUDNN_ENV, "always")
    assert _routing(monkeypatch, 2000, 2000) == "CUDNN_ATTENTION"
    assert _routing(monkeypatch, 5000, 8192 + 5000) == "split"
    assert _routing(monkeypatch, 5000, 8192 + 5000, on_cuda=False) == "split"  # the CPU's flash form, any shape
    monkeypatch.setenv(CUDNN_ENV, "1")
    with pytest.raises(ValueError, match=CUDNN_ENV):
        _routing(monkeypatch, 8, 8)


def test_prepare_cudnn_runs_each_form_once_on_cuda_in_16_bit_only(monkeypatch):
    """Start-up runs a square chunk and a chunk after a prefix (both cuDNN forms) at the aligned
    step, with the rank's heads; on the CPU or in fp32 (where cuDNN never runs) it does nothing."""
    from sglang_m3.msa import dense_prefill

    calls = []
    monkeypatch.setattr(dense_prefill, "causal_sdpa", lambda q, keys, values, scale: calls.append((tuple(q.shape), tuple(keys.shape), q.dtype)))
    assert dense_prefill.prepare_cudnn(HQ, HKV, D, torch.bfloat16, torch.device("cpu")) == 0.0
    assert dense_prefill.prepare_cudnn(HQ, HKV, D, torch.float32, torch.device("cuda")) == 0.0
    assert calls == []

    monkeypatch.setattr(dense_prefill.torch, "randn", lambda *shape, device, dtype: torch.zeros(*shape, dtype=dtype))
    monkeypatch.setattr(dense_prefill.torch.cuda, "synchronize", lambda device: None)
    assert dense_prefill.prepare_cudnn(HQ, HKV, D, torch.bfloat16, torch.device("cuda")) >= 0.0
    step = dense_prefill.CUDNN_SHAPE_STEP
    assert calls == [((step, HQ, D), (step, HKV, D), torch.bfloat16), ((step, HQ, D), (2 * step, HKV, D), torch.bfloat16)]
    assert all(dense_prefill.cudnn_takes(q[0], keys[0]) for q, keys, _ in calls)


@given(chunk=st.integers(-1, 40_000), context=st.integers(1, 300_000), longest=st.integers(1, 300_000))
def test_chunk_plan_prefixes_are_the_full_chunks_cudnn_takes(chunk, context, longest):
    """Each listed prefix is a multiple of the chunk, leaves room for a whole chunk in the context,
    is at most the bound, and makes a shape cuDNN takes; none is missing between them."""
    from sglang_m3.msa.dense_prefill import chunk_plan_prefixes, cudnn_takes

    prefixes = chunk_plan_prefixes(chunk, context, longest)
    if chunk <= 0 or chunk % CUDNN_SHAPE_STEP or chunk > context:
        assert prefixes == []
        return
    assert prefixes == list(range(0, len(prefixes) * chunk, chunk))
    assert all(prefix <= longest and prefix + chunk <= context and cudnn_takes(chunk, prefix + chunk) for prefix in prefixes)
    next_prefix = len(prefixes) * chunk
    assert next_prefix > longest or next_prefix + chunk > context


def test_chunk_plan_prefixes_of_a_128k_server():
    from sglang_m3.msa.dense_prefill import DEFAULT_CHUNK_PLAN_PREFIX, chunk_plan_prefixes

    assert chunk_plan_prefixes(8192, 131456, DEFAULT_CHUNK_PLAN_PREFIX) == [8192 * k for k in range(16)]
    assert chunk_plan_prefixes(8192, 1_048_576, DEFAULT_CHUNK_PLAN_PREFIX) == [8192 * k for k in range(17)]
    assert chunk_plan_prefixes(8000, 131456, DEFAULT_CHUNK_PLAN_PREFIX) == []  # a chunk cuDNN does not take


def test_prebuild_chunk_plans_runs_each_full_chunk_once_on_cuda_in_16_bit_only(monkeypatch):
    """One call per full chunk, with the rank's heads and the serving call's layout: ``[tokens,
    heads, dim]`` queries, keys cut from one contiguous buffer as a gather leaves them."""
    from sglang_m3.msa import dense_prefill

    calls = []
    monkeypatch.setattr(dense_prefill, "causal_sdpa", lambda q, keys, values, scale: calls.append(
        (tuple(q.shape), tuple(keys.shape), keys.stride(), values.stride(), q.dtype, scale)))
    assert dense_prefill.prebuild_chunk_plans(HQ, HKV, D, torch.bfloat16, torch.device("cpu"), chunk=2048, context=10_000) == (0, 0.0)
    assert dense_prefill.prebuild_chunk_plans(HQ, HKV, D, torch.float32, torch.device("cuda"), chunk=2048, context=10_000) == (0, 0.0)
    assert calls == []

    monkeypatch.setattr(dense_prefill.torch, "randn", lambda *shape, device, dtype: torch.zeros(*shape, dtype=dtype))
    monkeypatch.setattr(dense_prefill.torch.cuda, "synchronize", lambda device: None)
    shapes, seconds = dense_prefill.prebuild_chunk_plans(HQ, HKV, D, torch.bfloat16, torch.device("cuda"), chunk=2048, context=10_000)
    assert (shapes, seconds >= 0) == (4, True)
    assert [(q, keys) for q, keys, *_ in calls] == [((2048, HQ, D), (2048 * k, HKV, D)) for k in (1, 2, 3, 4)]
    assert all(k_stride == v_stride == (HKV * D, D, 1) for _, _, k_stride, v_stride, _, _ in calls)
    assert {(dtype, scale) for *_, dtype, scale in calls} == {(torch.bfloat16, D**-0.5)}

    calls.clear()
    monkeypatch.setenv(dense_prefill.CHUNK_PLANS_ENV, "4096")
    assert dense_prefill.prebuild_chunk_plans(HQ, HKV, D, torch.bfloat16, torch.device("cuda"), chunk=2048, context=10_000)[0] == 3
    monkeypatch.setenv(dense_prefill.CHUNK_PLANS_ENV, "0")
    assert dense_prefill.prebuild_chunk_plans(HQ, HKV, D, torch.bfloat16, torch.device("cuda"), chunk=2048, context=10_000) == (0, 0.0)
    monkeypatch.setenv(dense_prefill.CHUNK_PLANS_ENV, "all")
    with pytest.raises(ValueError, match=dense_prefill.CHUNK_PLANS_ENV):
        dense_prefill.prebuild_chunk_plans(HQ, HKV, D, torch.bfloat16, torch.device("cuda"), chunk=2048, context=10_000)


def test_on_the_cpu_a_fresh_chunk_attends_its_tokens_as_cached():
    """SGLang's torch-native backend (the CPU's) reads a chunk's own K/V back from the cache, so an
    fp8 cache's rounding reaches the chunk itself; this path reads them the same way there."""
    req_to_token, fb, k_all, v_all, q = _setup([23], [23])
    k_all, v_all, q = k_all.float(), v_all.float(), q.float()
    k_cache, v_cache = torch.zeros(len(k_all), HKV, D, dtype=torch.float8_e4m3fn), torch.zeros(len(v_all), HKV, D, dtype=torch.float8_e4m3fn)
    runner = SimpleNamespace(req_to_token_pool=SimpleNamespace(req_to_token=req_to_token), token_to_kv_pool=_DensePool(k_cache, v_cache))
    path = SDPADensePrefill(runner)
    path.plan(fb)
    k_new, v_new = k_all[fb.out_cache_loc], v_all[fb.out_cache_loc]
    out = path.forward_extend(q, k_new.reshape(len(q), -1), v_new.reshape(len(q), -1), _layer(), fb)
    slots = req_to_token[1, :23]
    rounded = _reference(q.view(23, HQ, D), k_cache[slots].float(), v_cache[slots].float(), 0)
    torch.testing.assert_close(out.view(23, HQ, D), rounded, rtol=1e-5, atol=1e-5)
    assert (out.view(23, HQ, D) - _reference(q.view(23, HQ, D), k_new, v_new, 0)).abs().max() > 1e-3
