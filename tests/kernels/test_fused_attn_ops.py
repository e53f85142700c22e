"""The fused per-layer attention kernels (Triton interpreter, CPU) against the torch path.

``qk_norm_rope`` vs ``M3RMSNorm`` + ``PartialNeoxRotary`` (the modules the CPU path runs), and
``insert_kv_and_index`` vs index assignment; then the wiring: ``M3Attention`` picks the fused
kernel only for CUDA tensors and hands attention the same operands either way, and the MSA
backend's store goes through the pool's fused insert only on CUDA.

Tolerances. fp32: the kernel computes the torch path's formula step by step; only the order of
the mean's sum and the cos/sin/rsqrt implementations differ, ~1e-7 relative, so 1e-6 relative
(plus 1e-6 absolute near zero) holds with margin. bf16: both paths round the same fp32 values at
the same two points (normed heads, rotated channels); a ~1e-7 difference flips a rounding only
at a tie-adjacent value, by one bf16 ulp, and a flipped normed value moves a rotated channel by
at most (|cos| + |sin|) <= sqrt(2) of that ulp. So each element is within 2 ulps of its head's
largest magnitude (an ulp of x is at most 2^-7 |x| in bf16) and nearly all are bit-identical
(measured: 0.35 ulp at worst, 99.998% identical under the interpreter's numpy cos/sin).
Against the fp32 path cast to bf16 the bf16 path carries its own intermediate rounding (2^-9
relative on the normed heads, rotated through at most sqrt(2)) plus the final cast: within
2 ulps of the head's largest magnitude too (measured: 1.0).
"""

from __future__ import annotations

import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from msa_kernels.triton_cache_insert import insert_kv_and_index
from msa_kernels.triton_qk_norm_rope import HeadGroup, qk_norm_rope
from sglang_m3.models.layers import M3RMSNorm, PartialNeoxRotary

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="interpreter tests run on CPU machines; tests/gpu covers CUDA"
)

EPS = 1e-6
THETA = 5e6
BF16_ULP = 2.0**-7  # an ulp of x is at most this times |x|


def _norm(dim: int, gemma: bool, gen: torch.Generator) -> M3RMSNorm:
    norm = M3RMSNorm(dim, EPS, gemma)
    with torch.no_grad():
        norm.weight.copy_((0.0 if gemma else 1.0) + 0.3 * torch.randn(dim, generator=gen))
    return norm


def _torch_path(positions, rotary, norm, x):
    (out,) = rotary(positions, norm(x))
    return out


def _assert_fp32_close(got, want):
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def _assert_bf16_within(got, want, ulps):
    """Each element within ``ulps`` bf16 ulps of its head's largest magnitude."""
    scale = want.float().abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
    err = (got.float() - want.float()).abs()
    worst = (err / (scale * BF16_ULP)).max().item() if err.numel() else 0.0
    assert worst <= ulps, f"bf16 error {worst:.2f} ulps of the head scale > {ulps}"


def _check_groups(positions, rotary, pairs, dtype):
    """The fused launch over ``pairs`` of (x, norm) vs the torch path per group."""
    outs = qk_norm_rope(
        positions, rotary.inv_freq, [HeadGroup(x, n.weight) for x, n in pairs],
        rotary_dim=rotary.rotary_dim, eps=EPS, weight_offset=pairs[0][1].offset,
    )
    identical = total = 0
    for (x, norm), got in zip(pairs, outs):
        assert got.shape == x.shape and got.dtype == x.dtype and got.is_contiguous()
        want = _torch_path(positions, rotary, norm, x)
        if dtype == torch.float32:
            _assert_fp32_close(got, want)
        else:
            _assert_bf16_within(got, want, ulps=2)
            _assert_bf16_within(got, _torch_path(positions, rotary, norm, x.float()).to(dtype), ulps=2)
            identical += (got == want).sum().item()
            total += got.numel()
    assert total - identical <= 1 + 0.01 * total, f"only {identical}/{total} bf16 elements equal the torch path's"


def _packed_qkv(tokens, heads, kv_heads, dim, dtype, gen):
    """q, k, v as the model splits them: strided views into one [T, (H + 2 Hkv) * D] tensor."""
    qkv = (2 * torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen)).to(dtype)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    return q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim), v.view(tokens, kv_heads, dim)


def _layer_groups(tokens, heads, kv_heads, dim, index_heads, local, index_dim, gemma, dtype, seed):
    """The four groups of one sparse layer: q/k views of a packed qkv, the local index-query heads
    (a head slice of the projection's output) and the one index key."""
    gen = torch.Generator().manual_seed(seed)
    q, k, _ = _packed_qkv(tokens, heads, kv_heads, dim, dtype, gen)
    iq_all = (2 * torch.randn(tokens, index_heads * index_dim, generator=gen)).to(dtype)
    iq = iq_all.view(tokens, index_heads, index_dim)[:, local]
    ik = (2 * torch.randn(tokens, index_dim, generator=gen)).to(dtype).view(tokens, 1, index_dim)
    norms = [_norm(d, gemma, gen) for d in (dim, dim, index_dim, index_dim)]
    positions = torch.randint(0, 1 << 20, (tokens,), generator=gen)
    return positions, list(zip((q, k, iq, ik), norms))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "tokens, heads, kv_heads, dim, rotary_dim, index_heads, local, index_dim, gemma",
    [
        (2, 64, 4, 128, 64, 4, slice(0, 4), 128, True),  # M3's real widths at TP1
        (1, 16, 1, 128, 64, 4, slice(2, 3), 128, True),  # TP4 rank 2: one KV head, one local index head
        (3, 8, 2, 16, 8, 2, slice(0, 2), 16, False),  # tiny widths, plain norm
        (3, 4, 2, 16, 16, 2, slice(1, 2), 24, True),  # rotary_dim == head_dim; index dim not a power of 2
    ],
)
def test_sparse_layer_groups_match_torch_path(dtype, tokens, heads, kv_heads, dim, rotary_dim, index_heads, local, index_dim, gemma):
    positions, pairs = _layer_groups(tokens, heads, kv_heads, dim, index_heads, local, index_dim, gemma, dtype, seed=tokens + dim)
    _check_groups(positions, PartialNeoxRotary(rotary_dim, THETA), pairs, dtype)


@settings(max_examples=25, deadline=None)
@given(
    tokens=st.integers(0, 3),
    heads=st.integers(1, 5),
    half_rot=st.integers(1, 8),
    extra=st.integers(0, 9),
    gemma=st.booleans(),
    bf16=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_random_shapes_match_torch_path(tokens, heads, half_rot, extra, gemma, bf16, seed):
    """Any head count, even rotary_dim <= dim (dims not powers of two too), both norm forms, T = 0.."""
    dtype = torch.bfloat16 if bf16 else torch.float32
    dim = 2 * half_rot + extra
    gen = torch.Generator().manual_seed(seed)
    q, k, _ = _packed_qkv(tokens, heads, 1, dim, dtype, gen)
    pairs = [(q, _norm(dim, gemma, gen)), (k, _norm(dim, gemma, gen))]
    positions = torch.randint(0, 1 << 20, (tokens,), generator=gen)
    _check_groups(positions, PartialNeoxRotary(2 * half_rot, THETA), pairs, dtype)


def test_norm_rope_refuses_bad_operands():
    x = torch.zeros(2, 3, 16)
    w = torch.zeros(16)
    positions = torch.arange(2)
    rotary = PartialNeoxRotary(8, THETA)
    call = lambda groups, rot=8, freq=rotary.inv_freq: qk_norm_rope(positions, freq, groups, rotary_dim=rot, eps=EPS, weight_offset=1.0)  # noqa: E731
    with pytest.raises(ValueError, match="rotary_dim \\(32\\) exceeds head group 0"):
        call([HeadGroup(x, w)], rot=32, freq=PartialNeoxRotary(32, THETA).inv_freq)
    with pytest.raises(ValueError, match="head group 1: weight must be \\[16\\]"):
        call([HeadGroup(x, w), HeadGroup(x, torch.zeros(8))])
    with pytest.raises(ValueError, match="unit stride"):
        call([HeadGroup(x.transpose(1, 2), torch.zeros(3))])
    with pytest.raises(ValueError, match="1 to 4 head groups"):
        call([HeadGroup(x, w)] * 5)


# ---------------------------------------------------------------- cache insert


def _buffers(slots, kv_heads, dim, v_dim, index_dim, dtype, gen):
    """Buffers pre-filled with random values, so that a write to a wrong slot shows."""
    return (
        torch.randn(slots, kv_heads, dim, generator=gen).to(dtype),
        torch.randn(slots, kv_heads, v_dim, generator=gen).to(dtype),
        torch.randn(slots, index_dim, generator=gen).to(dtype),
    )


@pytest.mark.parametrize("loc_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize(
    "tokens, kv_heads, dim, index_dim, src_dtype, buf_dtype",
    [
        (3, 4, 128, 128, torch.bfloat16, torch.bfloat16),  # real widths
        (5, 2, 16, 16, torch.float32, torch.float32),  # tiny
        (5, 1, 16, 24, torch.float32, torch.bfloat16),  # cast on store; index dim not a power of 2
        (1, 3, 8, 8, torch.bfloat16, torch.float32),
        (0, 2, 16, 16, torch.float32, torch.float32),
    ],
)
def test_cache_insert_matches_index_assignment(loc_dtype, tokens, kv_heads, dim, index_dim, src_dtype, buf_dtype):
    gen = torch.Generator().manual_seed(tokens * 7 + dim)
    _, k, v = _packed_qkv(tokens, 2, kv_heads, dim, src_dtype, gen)  # strided views, as the model hands them
    index_k = torch.randn(tokens, index_dim, generator=gen).to(src_dtype)
    loc = torch.randperm(40, generator=gen)[:tokens].to(loc_dtype)
    got = _buffers(40, kv_heads, dim, dim, index_dim, buf_dtype, gen)
    want = tuple(b.clone() for b in got)
    insert_kv_and_index(loc, k, v, index_k, *got)
    for buf, new in zip(want, (k, v, index_k)):
        buf[loc.long()] = new.to(buf_dtype)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_cache_insert_without_index_keys():
    gen = torch.Generator().manual_seed(3)
    _, k, v = _packed_qkv(4, 1, 2, 16, torch.float32, gen)
    k_buf, v_buf, _ = _buffers(20, 2, 16, 16, 16, torch.float32, gen)
    k_want, v_want = k_buf.clone(), v_buf.clone()
    loc = torch.tensor([7, 0, 19, 3])
    insert_kv_and_index(loc, k, v, None, k_buf, v_buf, None)
    k_want[loc], v_want[loc] = k, v
    assert torch.equal(k_buf, k_want) and torch.equal(v_buf, v_want)
    with pytest.raises(ValueError, match="index_k and index_k_buffer must be given together"):
        insert_kv_and_index(loc, k, v, torch.zeros(4, 16), k_buf, v_buf, None)
    with pytest.raises(ValueError, match="do not match the buffers"):
        insert_kv_and_index(loc, k, v, None, torch.zeros(20, 2, 8), v_buf, None)


# ---------------------------------------------------------------- wiring in the model and the backend


@pytest.fixture(scope="module")
def tiny_text_spec():
    from sglang_m3.config import M3TextSpec
    from sglang_m3.tiny.checkpoint import TinyGeometry, text_config_shipped
    from sglang_m3.tiny.tokenizer import BOS, EOS, IMAGE_TOKEN, VIDEO_TOKEN

    config = text_config_shipped(TinyGeometry(), {BOS: 1, EOS: 2, IMAGE_TOKEN: 3, VIDEO_TOKEN: 4})
    return M3TextSpec.from_config(config)


def _rank(tp_size=1, tp_rank=0):
    """SGLang's parallel layers as one rank of ``tp_size``, without process groups (a scoped override)."""
    from sglang.srt.runtime_context import get_parallel

    group = types.SimpleNamespace(world_size=tp_size, rank_in_group=tp_rank)
    return get_parallel().override(tp_group=group, tp_size=tp_size, tp_rank=tp_rank)


def _attention(spec, layer_id, tp_size=1, tp_rank=0):
    """An M3Attention of one rank with random weights (norm weights too)."""
    from sglang_m3.models.minimax_m3 import M3Attention

    with _rank(tp_size, tp_rank):
        attention = M3Attention(spec, layer_id)
    gen = torch.Generator().manual_seed(layer_id)
    with torch.no_grad():
        for param in attention.parameters():
            param.copy_(0.3 * torch.randn(param.shape, generator=gen))
    return attention


class _Recorder(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.width, self.seen = width, None

    def forward(self, q, k, v, forward_batch, **extra):
        self.seen = {"q": q, "k": k, "v": v, **extra}
        return torch.zeros(q.shape[0], self.width)


def _forward_operands(attention, positions, hidden):
    """What ``attention.forward`` hands to attention (replaced by a recorder)."""
    attention.attn = _Recorder(attention.num_heads * attention.head_dim)
    with _rank():
        attention(positions, hidden, None)
    return attention.attn.seen


@pytest.mark.parametrize("layer_id", [0, 1])  # dense, sparse
def test_attention_dispatches_fused_only_for_cuda_and_hands_the_same_operands(tiny_text_spec, monkeypatch, layer_id):
    from sglang_m3.models import fused_attn_ops, minimax_m3

    attention = _attention(tiny_text_spec, layer_id)
    assert attention.is_sparse == (layer_id == 1)
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(5, tiny_text_spec.hidden_size, generator=gen)
    positions = torch.tensor([0, 1, 17, 300, 4095])

    calls = []
    real_fused = minimax_m3.norm_rope_fused
    monkeypatch.setattr(minimax_m3, "norm_rope_fused", lambda *a: calls.append(1) or real_fused(*a))
    reference = _forward_operands(attention, positions, hidden)  # CPU tensors: the torch path
    assert not calls

    # A CUDA device is what selects the fused path; without one, stand in for that decision and
    # run the kernel under the interpreter on the same CPU tensors.
    assert fused_attn_ops.fused_attn_ops_on(types.SimpleNamespace(is_cuda=True))
    monkeypatch.setattr(minimax_m3, "fused_attn_ops_on", lambda x: True)
    fused = _forward_operands(attention, positions, hidden)
    assert calls == [1]
    assert set(fused) == set(reference) == ({"q", "k", "v", "index_q", "index_k"} if layer_id else {"q", "k", "v"})
    for name in reference:
        assert fused[name].shape == reference[name].shape, name
        _assert_fp32_close(fused[name], reference[name])


def test_fused_switch_reads_the_environment(monkeypatch):
    from sglang_m3.models.fused_attn_ops import FUSED_ATTN_OPS_ENV, fused_attn_ops_on

    cuda_like = types.SimpleNamespace(is_cuda=True)
    monkeypatch.delenv(FUSED_ATTN_OPS_ENV, raising=False)
    assert fused_attn_ops_on(cuda_like) and not fused_attn_ops_on(torch.zeros(1))
    monkeypatch.setenv(FUSED_ATTN_OPS_ENV, "0")
    assert not fused_attn_ops_on(cuda_like)
    monkeypatch.setenv(FUSED_ATTN_OPS_ENV, "yes")
    with pytest.raises(ValueError, match=FUSED_ATTN_OPS_ENV):
        fused_attn_ops_on(cuda_like)


def test_index_heads_of_a_tensor_parallel_rank(tiny_text_spec):
    """TP2 rank 1: the fused call reads this rank's index-query head out of the full projection."""
    attention = _attention(tiny_text_spec, 1, tp_size=2, tp_rank=1)
    assert attention.local_index_heads == slice(1, 2)
    hidden = torch.randn(3, tiny_text_spec.hidden_size, generator=torch.Generator().manual_seed(9))
    positions = torch.tensor([2, 40, 41])
    with _rank(2, 1):
        index_q, index_k = attention.index_branch(positions, hidden)
        _, _, extra = attention.fused_norm_rope(positions, hidden, *_qk_views(attention, hidden))
    _assert_fp32_close(extra["index_q"], index_q)
    _assert_fp32_close(extra["index_k"], index_k)


def _qk_views(attention, hidden):
    qkv, _ = attention.qkv_proj(hidden)
    q_size, kv_size = attention.num_heads * attention.head_dim, attention.num_kv_heads * attention.head_dim
    q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
    return q, k


def _pool(spec, dtype):
    from sglang_m3.cache.index_kv_pool import indexed_pool_class

    return indexed_pool_class(spec)(
        size=64, page_size=16, dtype=dtype, head_num=spec.num_kv_heads, head_dim=spec.head_dim,
        layer_num=spec.num_layers, device="cpu", enable_memory_saver=False,
    )


def test_backend_store_uses_the_fused_insert_only_for_cuda(tiny_text_spec, monkeypatch):
    from sglang_m3.msa import backend

    spec = tiny_text_spec
    layer = types.SimpleNamespace(layer_id=2)
    gen = torch.Generator().manual_seed(11)
    _, k, v = _packed_qkv(4, spec.num_heads, spec.num_kv_heads, spec.head_dim, torch.float32, gen)
    index_k = torch.randn(4, spec.index_head_dim, generator=gen)
    batch = types.SimpleNamespace(out_cache_loc=torch.tensor([5, 70, 16, 33]))

    def store(pool):
        backend.MSATorchBackend._store(types.SimpleNamespace(token_to_kv_pool=pool), layer, batch, k, v, index_k)
        return pool.k_buffer[2], pool.v_buffer[2], pool.index_k_buffer[2]

    fused_calls = []
    fused_pool = _pool(spec, torch.bfloat16)
    real_store_fused = fused_pool.store_fused
    monkeypatch.setattr(fused_pool, "store_fused", lambda *a: fused_calls.append(1) or real_store_fused(*a))
    plain = store(_pool(spec, torch.bfloat16))  # CPU tensors: SGLang's store + set_index_k
    store(fused_pool)
    assert not fused_calls
    monkeypatch.setattr(backend, "fused_attn_ops_on", lambda x: True)  # as on CUDA
    fused_pool = _pool(spec, torch.bfloat16)
    real_store_fused = fused_pool.store_fused
    monkeypatch.setattr(fused_pool, "store_fused", lambda *a: fused_calls.append(1) or real_store_fused(*a))
    fused = store(fused_pool)
    assert fused_calls == [1]
    for got, want in zip(fused, plain):
        assert torch.equal(got, want)


def test_fp8_pool_keeps_sglangs_store(tiny_text_spec):
    """fp8 caches are stored as bytes (SGLang's store casts and views them): no fused insert."""
    pool = _pool(tiny_text_spec, torch.float8_e4m3fn)
    k = torch.zeros(1, tiny_text_spec.num_kv_heads, tiny_text_spec.head_dim)
    assert not pool.store_fused(1, torch.tensor([3]), k, k, torch.zeros(1, tiny_text_spec.index_head_dim))
