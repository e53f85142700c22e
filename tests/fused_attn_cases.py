"""Cases and checks shared by the fused attention-op tests on the CPU (Triton interpreter,
``tests/kernels/test_fused_attn_ops.py``) and on CUDA (``tests/gpu/test_fused_attn_ops_gpu.py``).

The reference is always the torch path the CPU platform serves: ``M3RMSNorm`` then
``PartialNeoxRotary`` for the heads, index assignment for the cache.

Tolerances. fp32: the kernel computes the torch path's formula step by step; only the order of
the mean's sum and the cos/sin/rsqrt implementations can differ, ~1e-7 relative, so 1e-6
relative (plus 1e-6 absolute near zero) holds with margin (measured: half of it at worst, under
the interpreter's numpy cos/sin). bf16: both paths round the same fp32 values at the same two
points (normed heads, rotated channels); a ~1e-7 difference flips a rounding only next to a tie,
by one bf16 ulp, and a flipped normed value moves a rotated channel by at most
(|cos| + |sin|) <= sqrt(2) of that ulp. So each element is within 2 ulps of its head's largest
magnitude (an ulp of x is at most 2^-7 |x| in bf16) and nearly all are bit-identical (measured:
0.35 ulp at worst, 99.998% identical). Against the fp32 path cast to bf16, the bf16 path carries
its own intermediate rounding (2^-9 relative on the normed heads, rotated through at most
sqrt(2)) plus the final cast: within 2 ulps of the head's largest magnitude too (measured: 1.0).
"""

from __future__ import annotations

import types

import torch

from msa_kernels.triton_qk_norm_rope import HeadGroup, qk_norm_rope
from sglang_m3.models.layers import M3RMSNorm, PartialNeoxRotary

EPS = 1e-6
THETA = 5e6
BF16_ULP = 2.0**-7  # an ulp of x is at most this times |x|
#: positions up to 2^20 (M3's 1M context): angles reach ~1e6 rad, where approximate cos/sin fail
MAX_POSITION = 1 << 20


def random_norm(dim: int, gemma: bool, gen: torch.Generator, device="cpu") -> M3RMSNorm:
    norm = M3RMSNorm(dim, EPS, gemma)
    with torch.no_grad():
        norm.weight.copy_((0.0 if gemma else 1.0) + 0.3 * torch.randn(dim, generator=gen))
    return norm.to(device)


def torch_path(positions, rotary, norm, x):
    (out,) = rotary(positions, norm(x))
    return out


def assert_fp32_close(got, want):
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def assert_bf16_within(got, want, ulps):
    """Each element within ``ulps`` bf16 ulps of its head's largest magnitude."""
    scale = want.float().abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
    err = (got.float() - want.float()).abs()
    worst = (err / (scale * BF16_ULP)).max().item() if err.numel() else 0.0
    assert worst <= ulps, f"bf16 error {worst:.2f} ulps of the head scale > {ulps}"


def check_groups(positions, rotary, pairs, dtype):
    """The fused launch over ``pairs`` of (x, norm) vs the torch path, group by group."""
    outs = qk_norm_rope(
        positions, rotary.inv_freq, [HeadGroup(x, n.weight) for x, n in pairs],
        rotary_dim=rotary.rotary_dim, eps=EPS, weight_offset=pairs[0][1].offset,
    )
    identical = total = 0
    for (x, norm), got in zip(pairs, outs):
        assert got.shape == x.shape and got.dtype == x.dtype and got.is_contiguous()
        want = torch_path(positions, rotary, norm, x)
        if dtype == torch.float32:
            assert_fp32_close(got, want)
        else:
            assert_bf16_within(got, want, ulps=2)
            assert_bf16_within(got, torch_path(positions, rotary, norm, x.float()).to(dtype), ulps=2)
            identical += (got == want).sum().item()
            total += got.numel()
    assert total - identical <= 1 + 0.01 * total, f"only {identical}/{total} bf16 elements equal the torch path's"


def packed_qkv(tokens, heads, kv_heads, dim, dtype, gen, device="cpu"):
    """q, k, v as the model splits them: strided views into one [T, (H + 2 Hkv) * D] tensor."""
    qkv = (2 * torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen)).to(dtype).to(device)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    return q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim), v.view(tokens, kv_heads, dim)


def layer_groups(tokens, heads, kv_heads, dim, index_heads, local, index_dim, gemma, dtype, seed, device="cpu"):
    """Positions and the four (x, norm) groups of one sparse layer: q/k views of a packed qkv,
    the local index-query heads (a head slice of the projection's output) and the index key."""
    gen = torch.Generator().manual_seed(seed)
    q, k, _ = packed_qkv(tokens, heads, kv_heads, dim, dtype, gen, device)
    iq_all = (2 * torch.randn(tokens, index_heads * index_dim, generator=gen)).to(dtype).to(device)
    iq = iq_all.view(tokens, index_heads, index_dim)[:, local]
    ik = (2 * torch.randn(tokens, index_dim, generator=gen)).to(dtype).to(device).view(tokens, 1, index_dim)
    norms = [random_norm(d, gemma, gen, device) for d in (dim, dim, index_dim, index_dim)]
    positions = torch.randint(0, MAX_POSITION, (tokens,), generator=gen).to(device)
    return positions, list(zip((q, k, iq, ik), norms))


def filled_buffers(slots, kv_heads, dim, v_dim, index_dim, dtype, gen, device="cpu"):
    """K, V and index-key buffers pre-filled with random values, so that a write to a wrong slot shows."""
    return tuple(
        torch.randn(shape, generator=gen).to(dtype).to(device)
        for shape in ((slots, kv_heads, dim), (slots, kv_heads, v_dim), (slots, index_dim))
    )


def tiny_text_spec():
    """The project's tiny M3 geometry (head dim 32, rotary 16, 8/2 heads, index dim 32), from its config."""
    from sglang_m3.config import M3TextSpec
    from sglang_m3.tiny.checkpoint import TinyGeometry, text_config_shipped
    from sglang_m3.tiny.tokenizer import BOS, EOS, IMAGE_TOKEN, VIDEO_TOKEN

    return M3TextSpec.from_config(text_config_shipped(TinyGeometry(), {BOS: 1, EOS: 2, IMAGE_TOKEN: 3, VIDEO_TOKEN: 4}))


def as_rank(tp_size=1, tp_rank=0):
    """SGLang's parallel layers as one rank of ``tp_size`` (MoE experts split by TP, no expert
    parallelism), without process groups (a scoped override)."""
    from sglang.srt.runtime_context import get_parallel

    group = types.SimpleNamespace(world_size=tp_size, rank_in_group=tp_rank)
    moe = {"moe_dp_size": 1, "moe_ep_size": 1, "moe_ep_rank": 0, "moe_tp_size": tp_size, "moe_tp_rank": tp_rank}
    return get_parallel().override(tp_group=group, tp_size=tp_size, tp_rank=tp_rank, **moe)


def random_attention(spec, layer_id, tp_size=1, tp_rank=0, device="cpu"):
    """An M3Attention of one rank with random weights (norm weights too)."""
    from sglang_m3.models.minimax_m3 import M3Attention

    with as_rank(tp_size, tp_rank):
        attention = M3Attention(spec, layer_id)
    gen = torch.Generator().manual_seed(layer_id)
    with torch.no_grad():
        for param in attention.parameters():
            param.copy_(0.3 * torch.randn(param.shape, generator=gen))
    return attention.to(device)


class _Recorder(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.width, self.seen = width, None

    def forward(self, q, k, v, forward_batch, **extra):
        self.seen = {"q": q, "k": k, "v": v, **extra}
        return q.new_zeros(q.shape[0], self.width)


def forward_operands(attention, positions, hidden):
    """What ``attention.forward`` hands to attention (replaced by a recorder)."""
    attention.attn = _Recorder(attention.num_heads * attention.head_dim)
    with as_rank():
        attention(positions, hidden, None)
    return attention.attn.seen


def qk_views(attention, hidden):
    """q and k as ``M3Attention.forward`` splits them from the packed projection."""
    qkv, _ = attention.qkv_proj(hidden)
    q_size, kv_size = attention.num_heads * attention.head_dim, attention.num_kv_heads * attention.head_dim
    q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
    return q, k


def pool_for(spec, dtype, device="cpu"):
    """The project's index-key KV pool for ``spec``: 64 slots of page 16."""
    from sglang_m3.cache.index_kv_pool import indexed_pool_class

    return indexed_pool_class(spec)(
        size=64, page_size=16, dtype=dtype, head_num=spec.num_kv_heads, head_dim=spec.head_dim,
        layer_num=spec.num_layers, device=device, enable_memory_saver=False,
    )
