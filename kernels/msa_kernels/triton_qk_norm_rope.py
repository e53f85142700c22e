"""Per-head RMSNorm + NeoX partial RoPE for up to four head groups in one Triton launch.

An M3 attention layer normalises and rotates four small head groups per token: the main queries
and keys (strided views into the packed qkv projection) and, on sparse layers, the index
queries and the one index key. Done with torch ops that is ~15 launches per group; here it is
one launch for all groups, reading the inputs through their strides (no copies).

The math follows the torch path of the model step by step, so that results agree to rounding:
``normed = (x32 * rsqrt(mean(x32^2) + eps)) * (offset + w32)`` rounded to the input dtype, then
RoPE on the first ``rotary_dim`` channels with ``angle = float(position) * inv_freq[i mod half]``,
``out = normed * cos + rotate_half(normed) * sin`` in fp32, rounded to the input dtype; the other
channels pass through normed. On CUDA, cos/sin/rsqrt come from libdevice (the functions torch's
CUDA kernels call; angles reach ~1e6 rad at 1M-token contexts, so the range reduction must be the
precise one) and floating-point contraction is off (torch rounds each product before the add).

Grid: (tokens, head blocks of every group). Graph-safe: nothing is read on the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from msa_kernels.triton_cast import round_cast

MAX_GROUPS = 4


@dataclass(frozen=True)
class HeadGroup:
    """One group of heads to normalise and rotate: ``x [tokens, heads, dim]`` (last dim unit
    stride, any token/head strides) and its norm weight ``[dim]``."""

    x: torch.Tensor
    weight: torch.Tensor


@triton.jit
def _norm_rope_block(
    pos, inv_freq_ptr, x_ptr, x_tok_stride, x_head_stride, o_ptr, o_tok_stride, o_head_stride, w_ptr,
    token, head_block, heads, eps, w_offset,
    D: tl.constexpr, BLOCK_D: tl.constexpr, ROT: tl.constexpr, BLOCK_H: tl.constexpr, PRECISE: tl.constexpr,
):
    """Norm + RoPE of heads ``head_block * BLOCK_H ..`` of one token of one group."""
    half: tl.constexpr = ROT // 2
    h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h < heads)[:, None] & (d < D)[None, :]
    in_rot = d < ROT
    # rotate_half partner: channel i < half reads -x[i + half]; half <= i < ROT reads x[i - half].
    partner = tl.where(d < half, d + half, tl.where(in_rot, d - half, d))
    sign = tl.where(d < half, -1.0, 1.0)

    row = x_ptr + token.to(tl.int64) * x_tok_stride + h.to(tl.int64)[:, None] * x_head_stride
    x = tl.load(row + d[None, :], mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(row + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    mean_sq = tl.sum(x * x, axis=1) / D
    if PRECISE:
        rstd = libdevice.rsqrt(mean_sq + eps)
    else:
        rstd = tl.math.rsqrt(mean_sq + eps)
    scale = w_offset + tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)
    scale_p = w_offset + tl.load(w_ptr + partner, mask=d < D, other=0.0).to(tl.float32)
    dtype = o_ptr.dtype.element_ty
    # The torch path rounds the normed heads to the input dtype before rotating them.
    normed = round_cast((x * rstd[:, None]) * scale[None, :], dtype)
    normed_p = round_cast((xp * rstd[:, None]) * scale_p[None, :], dtype)

    angle = pos * tl.load(inv_freq_ptr + (d % half), mask=in_rot, other=0.0).to(tl.float32)
    if PRECISE:
        cos, sin = libdevice.cos(angle), libdevice.sin(angle)
    else:
        cos, sin = tl.cos(angle), tl.sin(angle)
    rotated = normed.to(tl.float32) * cos[None, :] + (sign[None, :] * normed_p.to(tl.float32)) * sin[None, :]
    out = tl.where(in_rot[None, :], round_cast(rotated, dtype), normed)
    out_row = o_ptr + token.to(tl.int64) * o_tok_stride + h.to(tl.int64)[:, None] * o_head_stride
    tl.store(out_row + d[None, :], out, mask=mask)


@triton.jit
def qk_norm_rope_kernel(
    pos_ptr, inv_freq_ptr, eps, w_offset,
    x0, xt0, xh0, o0, ot0, oh0, w0, h0,
    x1, xt1, xh1, o1, ot1, oh1, w1, h1,
    x2, xt2, xh2, o2, ot2, oh2, w2, h2,
    x3, xt3, xh3, o3, ot3, oh3, w3, h3,
    D0: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr,
    BD0: tl.constexpr, BD1: tl.constexpr, BD2: tl.constexpr, BD3: tl.constexpr,
    ROT: tl.constexpr, BLOCK_H: tl.constexpr, PRECISE: tl.constexpr,
):
    """Program (token, b): head block ``b`` counted across groups 0..3 in order (an unused group has 0 heads)."""
    token = tl.program_id(0)
    b = tl.program_id(1)
    pos = tl.load(pos_ptr + token).to(tl.float32)
    end0 = tl.cdiv(h0, BLOCK_H)
    end1 = end0 + tl.cdiv(h1, BLOCK_H)
    end2 = end1 + tl.cdiv(h2, BLOCK_H)
    if b < end0:
        _norm_rope_block(pos, inv_freq_ptr, x0, xt0, xh0, o0, ot0, oh0, w0, token, b, h0, eps, w_offset, D0, BD0, ROT, BLOCK_H, PRECISE)
    elif b < end1:
        _norm_rope_block(pos, inv_freq_ptr, x1, xt1, xh1, o1, ot1, oh1, w1, token, b - end0, h1, eps, w_offset, D1, BD1, ROT, BLOCK_H, PRECISE)
    elif b < end2:
        _norm_rope_block(pos, inv_freq_ptr, x2, xt2, xh2, o2, ot2, oh2, w2, token, b - end1, h2, eps, w_offset, D2, BD2, ROT, BLOCK_H, PRECISE)
    else:
        _norm_rope_block(pos, inv_freq_ptr, x3, xt3, xh3, o3, ot3, oh3, w3, token, b - end2, h3, eps, w_offset, D3, BD3, ROT, BLOCK_H, PRECISE)


def _check_group(index: int, group: HeadGroup, tokens: int, rotary_dim: int) -> None:
    x, w = group.x, group.weight
    if x.dim() != 3 or x.shape[0] != tokens:
        raise ValueError(f"head group {index}: x must be [tokens={tokens}, heads, dim], got {tuple(x.shape)}")
    if x.shape[2] > 1 and x.stride(2) != 1:
        raise ValueError(f"head group {index}: the last dim of x must have unit stride, got strides {x.stride()}")
    if w.shape != (x.shape[2],):
        raise ValueError(f"head group {index}: weight must be [{x.shape[2]}], got {tuple(w.shape)}")
    if rotary_dim > x.shape[2]:
        raise ValueError(f"rotary_dim ({rotary_dim}) exceeds head group {index}'s head dim ({x.shape[2]})")


def qk_norm_rope(
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    groups: Sequence[HeadGroup],
    *,
    rotary_dim: int,
    eps: float,
    weight_offset: float,
) -> list[torch.Tensor]:
    """Normalise (per head, ``weight_offset + weight``) and rotate every group; new contiguous
    ``[tokens, heads, dim]`` tensors in the inputs' dtypes, in the order of ``groups``.

    ``positions [tokens]`` (any integer dtype), ``inv_freq [rotary_dim // 2]`` (the rotary's
    frequencies, fp32). ``rotary_dim`` must be even and at most every group's head dim.
    """
    if not 1 <= len(groups) <= MAX_GROUPS:
        raise ValueError(f"qk_norm_rope takes 1 to {MAX_GROUPS} head groups, got {len(groups)}")
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be a positive even number, got {rotary_dim}")
    if inv_freq.shape != (rotary_dim // 2,):
        raise ValueError(f"inv_freq must be [{rotary_dim // 2}] (rotary_dim // 2), got {tuple(inv_freq.shape)}")
    if positions.dim() != 1 or (positions.shape[0] > 1 and positions.stride(0) != 1):
        raise ValueError(f"positions must be a contiguous [tokens] tensor, got shape {tuple(positions.shape)} strides {positions.stride()}")
    tokens = positions.shape[0]
    for i, group in enumerate(groups):
        _check_group(i, group, tokens, rotary_dim)
    outs = [torch.empty(g.x.shape, dtype=g.x.dtype, device=g.x.device) for g in groups]
    if tokens == 0:
        return outs

    block_h = min(16, triton.next_power_of_2(max(g.x.shape[1] for g in groups)))
    args, dims = [], []
    padded = list(zip(groups, outs)) + [(groups[0], outs[0])] * (MAX_GROUPS - len(groups))
    for slot, (group, out) in enumerate(padded):
        x = group.x
        heads = x.shape[1] if slot < len(groups) else 0
        args += [x, x.stride(0), x.stride(1), out, out.stride(0), out.stride(1), group.weight, heads]
        dims.append(x.shape[2])
    blocks = sum(triton.cdiv(g.x.shape[1], block_h) for g in groups)
    precise = positions.is_cuda
    qk_norm_rope_kernel[(tokens, blocks)](
        positions, inv_freq, eps, weight_offset, *args,
        *dims, *(triton.next_power_of_2(dim) for dim in dims),
        ROT=rotary_dim, BLOCK_H=block_h, PRECISE=precise,
        **({"enable_fp_fusion": False} if precise else {}),
    )
    return outs
