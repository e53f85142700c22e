"""The fused per-layer attention kernels on CUDA against the torch path, at M3's real widths.

Same checks and tolerances as the interpreter tests (``tests/fused_attn_cases.py`` derives them),
here compiled (libdevice cos/sin/rsqrt, no FP contraction) at real widths and long-context
positions, plus what only a GPU shows: the model's dispatch on CUDA tensors against
``SGLANG_M3_FUSED_ATTN_OPS=0``, the MSA backend's store through a CUDA pool, and both kernels
captured in a CUDA graph and replayed on new inputs. Skipped without CUDA.
"""

from __future__ import annotations

import types

import fused_attn_cases as cases
import pytest
import torch

from msa_kernels.triton_cache_insert import insert_kv_and_index
from msa_kernels.triton_qk_norm_rope import HeadGroup, qk_norm_rope
from sglang_m3.models.layers import PartialNeoxRotary

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = "cuda"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 7, 300])
@pytest.mark.parametrize(
    "heads, kv_heads, local, gemma",
    [
        (64, 4, slice(0, 4), True),  # TP1
        (16, 1, slice(3, 4), True),  # TP4 rank 3
        (64, 4, slice(0, 4), False),  # plain norm form
    ],
)
def test_real_width_groups_match_torch_path(dtype, tokens, heads, kv_heads, local, gemma):
    positions, pairs = cases.layer_groups(tokens, heads, kv_heads, 128, 4, local, 128, gemma, dtype, seed=tokens, device=CUDA)
    cases.check_groups(positions, PartialNeoxRotary(64, cases.THETA).to(CUDA), pairs, dtype)


@pytest.mark.parametrize("loc_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 300])
def test_cache_insert_matches_index_assignment(loc_dtype, src_dtype, tokens):
    gen = torch.Generator().manual_seed(tokens)
    _, k, v = cases.packed_qkv(tokens, 64, 4, 128, src_dtype, gen, CUDA)
    index_k = torch.randn(tokens, 128, generator=gen).to(src_dtype).to(CUDA)
    loc = torch.randperm(4096, generator=gen)[:tokens].to(loc_dtype).to(CUDA)
    got = cases.filled_buffers(4096, 4, 128, 128, 128, torch.bfloat16, gen, CUDA)
    want = tuple(b.clone() for b in got)
    insert_kv_and_index(loc, k, v, index_k, *got)
    for buf, new in zip(want, (k, v, index_k)):
        buf[loc.long()] = new.to(buf.dtype)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@pytest.mark.parametrize("layer_id", [0, 1])  # dense, sparse
def test_model_takes_the_fused_path_on_cuda(monkeypatch, layer_id):
    """On CUDA tensors M3Attention runs the fused kernel; SGLANG_M3_FUSED_ATTN_OPS=0 gives the
    torch path; both hand attention the same operands."""
    from sglang_m3.models import minimax_m3
    from sglang_m3.models.fused_attn_ops import FUSED_ATTN_OPS_ENV

    spec = cases.tiny_text_spec()
    attention = cases.random_attention(spec, layer_id, device=CUDA)
    hidden = torch.randn(9, spec.hidden_size, generator=torch.Generator().manual_seed(1)).to(CUDA)
    positions = torch.tensor([0, 1, 2, 15, 16, 17, 1000, 4095, (1 << 20) - 1], device=CUDA)
    calls = []
    real_fused = minimax_m3.norm_rope_fused
    monkeypatch.setattr(minimax_m3, "norm_rope_fused", lambda *a: calls.append(1) or real_fused(*a))
    monkeypatch.setenv(FUSED_ATTN_OPS_ENV, "0")
    reference = cases.forward_operands(attention, positions, hidden)
    assert not calls
    monkeypatch.delenv(FUSED_ATTN_OPS_ENV)
    fused = cases.forward_operands(attention, positions, hidden)
    assert calls == [1]
    assert set(fused) == set(reference)
    for name in reference:
        cases.assert_fp32_close(fused[name], reference[name])


def test_backend_store_through_a_cuda_pool(monkeypatch):
    from sglang_m3.models.fused_attn_ops import FUSED_ATTN_OPS_ENV
    from sglang_m3.msa.backend import MSATorchBackend

    spec = cases.tiny_text_spec()
    gen = torch.Generator().manual_seed(2)
    _, k, v = cases.packed_qkv(5, spec.num_heads, spec.num_kv_heads, spec.head_dim, torch.float32, gen, CUDA)
    index_k = torch.randn(5, spec.index_head_dim, generator=gen).to(CUDA)
    batch = types.SimpleNamespace(out_cache_loc=torch.tensor([3, 64, 20, 21, 50], device=CUDA))
    layer = types.SimpleNamespace(layer_id=1, k_scale=None, v_scale=None)  # RadixAttention without KV scales

    @torch.no_grad()  # as in the server: SGLang's store_cache custom op is registered for the eager, grad-free call
    def store():
        pool = cases.pool_for(spec, torch.bfloat16, CUDA)
        MSATorchBackend._store(types.SimpleNamespace(token_to_kv_pool=pool), layer, batch, k, v, index_k)
        return pool.k_buffer[1], pool.v_buffer[1], pool.index_k_buffer[1]

    monkeypatch.setenv(FUSED_ATTN_OPS_ENV, "0")
    plain = store()
    monkeypatch.delenv(FUSED_ATTN_OPS_ENV)
    fused = store()
    assert torch.equal(plain[2][batch.out_cache_loc], index_k.to(torch.bfloat16))
    for got, want in zip(fused, plain):
        assert torch.equal(got, want)


def test_both_kernels_replay_in_a_cuda_graph():
    """Captured once, replayed on inputs rewritten in place: the same results as eager calls."""
    tokens, dtype = 16, torch.bfloat16
    positions, pairs = cases.layer_groups(tokens, 64, 4, 128, 4, slice(0, 4), 128, True, dtype, seed=0, device=CUDA)
    rotary = PartialNeoxRotary(64, cases.THETA).to(CUDA)
    groups = [HeadGroup(x, n.weight) for x, n in pairs]
    gen = torch.Generator().manual_seed(4)
    v = torch.randn(tokens, 4, 128, generator=gen).to(dtype).to(CUDA)
    loc = torch.randperm(1024, generator=gen)[:tokens].to(CUDA)
    buffers = cases.filled_buffers(1024, 4, 128, 128, 128, dtype, gen, CUDA)

    def step():
        outs = qk_norm_rope(positions, rotary.inv_freq, groups, rotary_dim=64, eps=1e-6, weight_offset=1.0)
        insert_kv_and_index(loc, outs[1], v, outs[3].view(tokens, 128), *buffers)
        return outs

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_outs = step()

    new_positions, new_pairs = cases.layer_groups(tokens, 64, 4, 128, 4, slice(0, 4), 128, True, dtype, seed=1, device=CUDA)
    positions.copy_(new_positions)
    for (x, _), (new_x, _) in zip(pairs, new_pairs):
        x.copy_(new_x)
    loc.copy_(torch.randperm(1024, generator=gen)[:tokens].to(CUDA))
    graph.replay()
    replayed = [o.clone() for o in graph_outs]
    replayed_buffers = [b.clone() for b in buffers]
    eager = step()
    for got, want in zip(replayed, eager):
        assert torch.equal(got, want)
    for got, want in zip(replayed_buffers, buffers):
        assert torch.equal(got, want)
    assert torch.equal(buffers[2][loc], eager[3].view(tokens, 128))
