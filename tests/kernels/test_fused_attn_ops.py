"""The fused per-layer attention kernels (Triton interpreter, CPU) against the torch path.

``qk_norm_rope`` vs ``M3RMSNorm`` + ``PartialNeoxRotary`` (the modules the CPU path runs), and
``insert_kv_and_index`` vs index assignment; then the wiring: ``M3Attention`` picks the fused
kernel only for CUDA tensors and hands attention the same operands either way, and the MSA
backend's store goes through the pool's fused insert only on CUDA. Tolerances are derived in
``tests/fused_attn_cases.py``; ``tests/gpu/test_fused_attn_ops_gpu.py`` runs the same checks on CUDA.
"""

from __future__ import annotations

import types

import pytest
import torch
from interpreter_only import INTERPRETER_ONLY
from fused_attn_cases import (
    THETA,
    as_rank,
    assert_fp32_close,
    check_groups,
    filled_buffers,
    forward_operands,
    layer_groups,
    packed_qkv,
    pool_for,
    qk_views,
    random_attention,
    random_norm,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from msa_kernels.triton_cache_insert import insert_kv_and_index
from msa_kernels.triton_qk_norm_rope import HeadGroup, qk_norm_rope
from sglang_m3.models.layers import PartialNeoxRotary

pytestmark = INTERPRETER_ONLY


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
    positions, pairs = layer_groups(tokens, heads, kv_heads, dim, index_heads, local, index_dim, gemma, dtype, seed=tokens + dim)
    check_groups(positions, PartialNeoxRotary(rotary_dim, THETA), pairs, dtype)


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
    q, k, _ = packed_qkv(tokens, heads, 1, dim, dtype, gen)
    pairs = [(q, random_norm(dim, gemma, gen)), (k, random_norm(dim, gemma, gen))]
    positions = torch.randint(0, 1 << 20, (tokens,), generator=gen)
    check_groups(positions, PartialNeoxRotary(2 * half_rot, THETA), pairs, dtype)


def test_norm_rope_refuses_bad_operands():
    x = torch.zeros(2, 3, 16)
    w = torch.zeros(16)
    rotary = PartialNeoxRotary(8, THETA)

    def call(groups, rot=8, freq=rotary.inv_freq, positions=torch.arange(2)):
        return qk_norm_rope(positions, freq, groups, rotary_dim=rot, eps=1e-6, weight_offset=1.0)

    with pytest.raises(ValueError, match="rotary_dim \\(32\\) exceeds head group 0"):
        call([HeadGroup(x, w)], rot=32, freq=PartialNeoxRotary(32, THETA).inv_freq)
    with pytest.raises(ValueError, match="head group 1: weight must be \\[16\\]"):
        call([HeadGroup(x, w), HeadGroup(x, torch.zeros(8))])
    with pytest.raises(ValueError, match="unit stride"):
        call([HeadGroup(x.transpose(1, 2), torch.zeros(3))])
    with pytest.raises(ValueError, match="1 to 4 head groups"):
        call([HeadGroup(x, w)] * 5)
    with pytest.raises(ValueError, match="positions must be a contiguous"):
        call([HeadGroup(x, w)], positions=torch.arange(4)[::2])


# ---------------------------------------------------------------- cache insert


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
    _, k, v = packed_qkv(tokens, 2, kv_heads, dim, src_dtype, gen)  # strided views, as the model hands them
    index_k = torch.randn(tokens, index_dim, generator=gen).to(src_dtype)
    loc = torch.randperm(40, generator=gen)[:tokens].to(loc_dtype)
    got = filled_buffers(40, kv_heads, dim, dim, index_dim, buf_dtype, gen)
    want = tuple(b.clone() for b in got)
    insert_kv_and_index(loc, k, v, index_k, *got)
    for buf, new in zip(want, (k, v, index_k)):
        buf[loc.long()] = new.to(buf_dtype)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_cache_insert_without_index_keys():
    gen = torch.Generator().manual_seed(3)
    _, k, v = packed_qkv(4, 1, 2, 16, torch.float32, gen)
    k_buf, v_buf, _ = filled_buffers(20, 2, 16, 16, 16, torch.float32, gen)
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
def tiny_spec():
    from fused_attn_cases import tiny_text_spec

    return tiny_text_spec()


@pytest.mark.parametrize("layer_id", [0, 1])  # dense, sparse
def test_attention_dispatches_fused_only_for_cuda_and_hands_the_same_operands(tiny_spec, monkeypatch, layer_id):
    from sglang_m3.models import fused_attn_ops, minimax_m3

    attention = random_attention(tiny_spec, layer_id)
    assert attention.is_sparse == (layer_id == 1)
    hidden = torch.randn(5, tiny_spec.hidden_size, generator=torch.Generator().manual_seed(5))
    positions = torch.tensor([0, 1, 17, 300, 4095])

    calls = []
    real_fused = minimax_m3.norm_rope_fused
    monkeypatch.setattr(minimax_m3, "norm_rope_fused", lambda *a: calls.append(1) or real_fused(*a))
    reference = forward_operands(attention, positions, hidden)  # CPU tensors: the torch path
    assert not calls

    # A CUDA device is what selects the fused path; without one, stand in for that decision and
    # run the kernel under the interpreter on the same CPU tensors.
    assert fused_attn_ops.fused_attn_ops_on(types.SimpleNamespace(is_cuda=True))
    monkeypatch.setattr(minimax_m3, "fused_attn_ops_on", lambda x: True)
    fused = forward_operands(attention, positions, hidden)
    assert calls == [1]
    assert set(fused) == set(reference) == ({"q", "k", "v", "index_q", "index_k"} if layer_id else {"q", "k", "v"})
    for name in reference:
        assert fused[name].shape == reference[name].shape, name
        assert_fp32_close(fused[name], reference[name])


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


def test_index_heads_of_a_tensor_parallel_rank(tiny_spec):
    """TP2 rank 1: the fused call reads this rank's index-query head out of the full projection."""
    attention = random_attention(tiny_spec, 1, tp_size=2, tp_rank=1)
    assert attention.local_index_heads == slice(1, 2)
    hidden = torch.randn(3, tiny_spec.hidden_size, generator=torch.Generator().manual_seed(9))
    positions = torch.tensor([2, 40, 41])
    with as_rank(2, 1):
        index_q, index_k = attention.index_branch(positions, hidden)
        _, _, extra = attention.fused_norm_rope(positions, hidden, *qk_views(attention, hidden))
    assert_fp32_close(extra["index_q"], index_q)
    assert_fp32_close(extra["index_k"], index_k)


def test_backend_store_uses_the_fused_insert_only_for_cuda(tiny_spec, monkeypatch):
    from sglang_m3.msa import backend

    layer = types.SimpleNamespace(layer_id=2, k_scale=None, v_scale=None)  # RadixAttention without KV scales
    gen = torch.Generator().manual_seed(11)
    _, k, v = packed_qkv(4, tiny_spec.num_heads, tiny_spec.num_kv_heads, tiny_spec.head_dim, torch.float32, gen)
    index_k = torch.randn(4, tiny_spec.index_head_dim, generator=gen)
    batch = types.SimpleNamespace(out_cache_loc=torch.tensor([5, 70, 16, 33]))
    fused_calls = []

    def store():
        """A bf16 pool after the backend stored the fp32 rows, spying on the pool's fused insert."""
        pool = pool_for(tiny_spec, torch.bfloat16)
        real_store_fused = pool.store_fused
        monkeypatch.setattr(pool, "store_fused", lambda *a: fused_calls.append(1) or real_store_fused(*a))
        backend.MSATorchBackend._store(types.SimpleNamespace(token_to_kv_pool=pool), layer, batch, k, v, index_k)
        return pool.k_buffer[2], pool.v_buffer[2], pool.index_k_buffer[2]

    plain = store()  # CPU tensors: SGLang's set_kv_buffer + set_index_k
    assert not fused_calls
    assert torch.equal(plain[2][batch.out_cache_loc], index_k.to(torch.bfloat16))
    monkeypatch.setattr(backend, "fused_attn_ops_on", lambda x: True)  # as on CUDA
    fused = store()
    assert fused_calls == [1]
    for got, want in zip(fused, plain):
        assert torch.equal(got, want)


def test_fp8_pool_keeps_sglangs_store(tiny_spec):
    """fp8 caches are stored as bytes (SGLang's store casts and views them): no fused insert."""
    pool = pool_for(tiny_spec, torch.float8_e4m3fn)
    k = torch.zeros(1, tiny_spec.num_kv_heads, tiny_spec.head_dim)
    assert not pool.store_fused(1, torch.tensor([3]), k, k, torch.zeros(1, tiny_spec.index_head_dim))


# ---------------------------------------------------------------- compiled form (no GPU needed)

_COMPILE_FOR_HOPPER = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from msa_kernels.triton_cache_insert import cache_insert_kernel
from msa_kernels.triton_qk_norm_rope import qk_norm_rope_kernel

def signature(kernel, consts, pointer):
    return {n: "constexpr" if n in consts else pointer(n) for n in kernel.arg_names}

for dtype in ("bf16", "fp32"):
    consts = dict(D0=128, D1=128, D2=128, D3=128, BD0=128, BD1=128, BD2=128, BD3=128, ROT=64, BLOCK_H=16, PRECISE=True)
    types = {"pos_ptr": "*i64", "inv_freq_ptr": "*fp32", "eps": "fp32", "w_offset": "fp32"}
    pointer = lambda n: types.get(n) or (f"*{dtype}" if n[0] in "xow" and n[1:].isdigit() else "i32")
    ptx = triton.compile(ASTSource(qk_norm_rope_kernel, signature(qk_norm_rope_kernel, consts, pointer), consts),
                         target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": False}).asm["ptx"]
    assert "cos.approx" not in ptx and "sin.approx" not in ptx, "approximate cos/sin in the compiled kernel"
    assert "fma.rn.f32" not in ptx, "contracted multiply-adds in the compiled kernel"
    consts = dict(HK=4, D=128, DV=128, DI=128, BLOCK_HK=4, BD=128, BDV=128, BDI=128, HAS_INDEX=True)
    buffers = ("kb_ptr", "vb_ptr", "ib_ptr")
    pointer = lambda n: "*i64" if n == "loc_ptr" else "*bf16" if n in buffers else f"*{dtype}" if n.endswith("_ptr") else "i32"
    triton.compile(ASTSource(cache_insert_kernel, signature(cache_insert_kernel, consts, pointer), consts),
                   target=GPUTarget("cuda", 90, 32))
print("compiled")
"""


def test_kernels_compile_for_hopper():
    """The interpreter does not run Triton's compiler: compile both kernels for sm_90 (no GPU
    needed) and check the compiled norm/RoPE uses precise cos/sin and no contracted FMAs."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-c", _COMPILE_FOR_HOPPER], env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]
