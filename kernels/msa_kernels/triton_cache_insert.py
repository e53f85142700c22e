"""One Triton launch that writes a sparse layer's new K, V and index keys into the KV cache.

The per-token slot ids (``loc``) are shared by the main K/V and the index key (the index key
lives at the same slot as its K/V), so one program per token writes all three rows; torch needs
three scatter launches plus a dtype cast per operand. Inputs are read through their strides (the
model may hand views into a packed projection); values are rounded to the buffers' dtypes the
way ``.to(dtype)`` does. Graph-safe: nothing is read on the host. An fp8 index-key buffer (with
its per-token scales) is written quantized, as ``msa_kernels.reference.quantize_index_keys`` does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from msa_kernels.triton_cast import round_cast
from msa_kernels.triton_index_quant import quantize_e4m3_row


@triton.jit
def _copy_rows(src_ptr, src_tok_stride, src_head_stride, dst_ptr, dst_slot_stride, dst_head_stride, token, slot,
               HEADS: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h < HEADS)[:, None] & (d < D)[None, :]
    src = src_ptr + token.to(tl.int64) * src_tok_stride + h.to(tl.int64)[:, None] * src_head_stride + d[None, :]
    dst = dst_ptr + slot * dst_slot_stride + h.to(tl.int64)[:, None] * dst_head_stride + d[None, :]
    x = tl.load(src, mask=mask)
    if x.dtype != dst_ptr.dtype.element_ty:
        x = round_cast(x.to(tl.float32), dst_ptr.dtype.element_ty)
    tl.store(dst, x, mask=mask)


@triton.jit
def _quantize_index_row(ik_ptr, ik_st, ib_ptr, ib_ss, scale_ptr, token, slot, DI: tl.constexpr, BDI: tl.constexpr):
    d = tl.arange(0, BDI)
    x = tl.load(ik_ptr + token.to(tl.int64) * ik_st + d, mask=d < DI, other=0.0).to(tl.float32)
    values, scale = quantize_e4m3_row(x)
    tl.store(ib_ptr + slot * ib_ss + d, values.to(ib_ptr.dtype.element_ty), mask=d < DI)
    tl.store(scale_ptr + slot, scale)


@triton.jit
def cache_insert_kernel(
    loc_ptr,
    k_ptr, k_st, k_sh, v_ptr, v_st, v_sh, ik_ptr, ik_st,
    kb_ptr, kb_ss, kb_sh, vb_ptr, vb_ss, vb_sh, ib_ptr, ib_ss, is_ptr,
    HK: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, DI: tl.constexpr,
    BLOCK_HK: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, BDI: tl.constexpr, HAS_INDEX: tl.constexpr,
    INDEX_FP8: tl.constexpr,
):
    """Program ``t``: token t's K [HK, D], V [HK, DV] and (HAS_INDEX) index key [DI] to slot ``loc[t]``.

    ``INDEX_FP8``: the index key goes in quantized, its scale to ``is_ptr[slot]``.
    """
    token = tl.program_id(0)
    slot = tl.load(loc_ptr + token).to(tl.int64)
    _copy_rows(k_ptr, k_st, k_sh, kb_ptr, kb_ss, kb_sh, token, slot, HK, D, BLOCK_HK, BD)
    _copy_rows(v_ptr, v_st, v_sh, vb_ptr, vb_ss, vb_sh, token, slot, HK, DV, BLOCK_HK, BDV)
    if HAS_INDEX:
        if INDEX_FP8:
            _quantize_index_row(ik_ptr, ik_st, ib_ptr, ib_ss, is_ptr, token, slot, DI, BDI)
        else:
            _copy_rows(ik_ptr, ik_st, 0, ib_ptr, ib_ss, 0, token, slot, 1, DI, 1, BDI)


def _check_rows(name: str, x: torch.Tensor, rank: int, shape_hint: str) -> None:
    if x.dim() != rank:
        raise ValueError(f"{name} must be {shape_hint}, got shape {tuple(x.shape)}")
    if x.shape[-1] > 1 and x.stride(-1) != 1:
        raise ValueError(f"the last dim of {name} must have unit stride, got strides {x.stride()}")


def insert_kv_and_index(
    loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    index_k: torch.Tensor | None,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    index_k_buffer: torch.Tensor | None,
    index_k_scale_buffer: torch.Tensor | None = None,
) -> None:
    """``k_buffer[loc] = k``, ``v_buffer[loc] = v``, ``index_k_buffer[loc] = index_k`` in one launch.

    ``loc [T]`` int32/int64 slot ids; ``k [T, Hk, D]``, ``v [T, Hk, Dv]``, ``index_k [T, Di]``
    (or ``None`` together with ``index_k_buffer``); buffers ``[slots, Hk, D]``, ``[slots, Hk, Dv]``,
    ``[slots, Di]``. Values are cast to each buffer's dtype. A float8_e4m3fn ``index_k_buffer``
    takes its fp32 per-slot scales in ``index_k_scale_buffer [slots]``.
    """
    if loc.dim() != 1 or (loc.shape[0] > 1 and loc.stride(0) != 1):
        raise ValueError(f"loc must be a contiguous [tokens] tensor of slot ids, got shape {tuple(loc.shape)} strides {loc.stride()}")
    tokens = loc.shape[0]
    _check_rows("k", k, 3, "[tokens, kv heads, head dim]")
    _check_rows("v", v, 3, "[tokens, kv heads, v head dim]")
    _check_rows("k_buffer", k_buffer, 3, "[slots, kv heads, head dim]")
    _check_rows("v_buffer", v_buffer, 3, "[slots, kv heads, v head dim]")
    if k.shape[0] != tokens or v.shape[0] != tokens:
        raise ValueError(f"k and v must have loc's {tokens} tokens, got {k.shape[0]} and {v.shape[0]}")
    if k.shape[1:] != k_buffer.shape[1:] or v.shape[1:] != v_buffer.shape[1:]:
        raise ValueError(
            f"k/v rows {tuple(k.shape[1:])}/{tuple(v.shape[1:])} do not match the buffers' "
            f"{tuple(k_buffer.shape[1:])}/{tuple(v_buffer.shape[1:])}"
        )
    if (index_k is None) != (index_k_buffer is None):
        raise ValueError("index_k and index_k_buffer must be given together")
    has_index = index_k is not None
    if has_index:
        _check_rows("index_k", index_k, 2, "[tokens, index head dim]")
        _check_rows("index_k_buffer", index_k_buffer, 2, "[slots, index head dim]")
        if index_k.shape[0] != tokens or index_k.shape[1] != index_k_buffer.shape[1]:
            raise ValueError(
                f"index_k must be [{tokens}, {index_k_buffer.shape[1]}] (tokens, buffer width), got {tuple(index_k.shape)}"
            )
    index_fp8 = has_index and index_k_buffer.dtype == torch.float8_e4m3fn
    if index_fp8 != (index_k_scale_buffer is not None):
        raise ValueError("index_k_scale_buffer must be given exactly when index_k_buffer is float8_e4m3fn")
    if index_fp8 and (index_k_scale_buffer.dtype != torch.float32 or index_k_scale_buffer.shape != index_k_buffer.shape[:1]):
        raise ValueError(
            f"index_k_scale_buffer must be float32 [{index_k_buffer.shape[0]}] (one scale per slot), "
            f"got {index_k_scale_buffer.dtype} {tuple(index_k_scale_buffer.shape)}"
        )
    if tokens == 0:
        return
    heads, dim, v_dim = k.shape[1], k.shape[2], v.shape[2]
    ik, ib = (index_k, index_k_buffer) if has_index else (k, k_buffer)
    index_dim = ik.shape[-1]
    cache_insert_kernel[(tokens,)](
        loc,
        k, k.stride(0), k.stride(1), v, v.stride(0), v.stride(1), ik, ik.stride(0),
        k_buffer, k_buffer.stride(0), k_buffer.stride(1), v_buffer, v_buffer.stride(0), v_buffer.stride(1),
        ib, ib.stride(0), index_k_scale_buffer if index_fp8 else ib,
        HK=heads, D=dim, DV=v_dim, DI=index_dim,
        BLOCK_HK=triton.next_power_of_2(heads), BD=triton.next_power_of_2(dim),
        BDV=triton.next_power_of_2(v_dim), BDI=triton.next_power_of_2(index_dim), HAS_INDEX=has_index,
        INDEX_FP8=index_fp8,
    )
