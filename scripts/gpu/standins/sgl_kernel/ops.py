"""The ``sgl_kernel`` ops the harness implements, in Triton or torch, each with a torch reference.

Only ops that SGLang's CUDA paths reach on the harness platform live here: the fused-MoE Triton
path combines expert outputs with ``moe_sum_reduce`` and asks the ahead-of-time backend for
``moe_align_block_size``; ``silu_and_mul`` and ``topk_sigmoid`` are imported by CUDA modules and
cheap to provide faithfully; the RMSNorm family (plain and Gemma, with and without the fused
residual add) serves SGLang's norm layers when the platform routes them to their CUDA forwards
(``M3_HARNESS_CUDA_CUSTOM_OPS``, ``m3_gpu_harness.platform``). Each op records that it ran
(``_standin.note_ran``).

This module imports nothing from ``sgl_kernel`` itself, so tests can load it on its own (under
another module name) without putting a fake ``sgl_kernel`` on a CPU test process's path.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

try:  # inside the stand-in package
    from ._standin import StandInMissing, note_ran
except ImportError:  # loaded as a lone module by the tests
    class StandInMissing(NotImplementedError):
        pass

    def note_ran(name: str) -> None:
        return None


# --- silu_and_mul: out = silu(x[..., :d]) * x[..., d:] ------------------------------------------

@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, d, x_row_stride, out_row_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < d
    gate = tl.load(x_ptr + row * x_row_stride + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_row_stride + d + offs, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * out_row_stride + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(input: torch.Tensor, out: Optional[torch.Tensor] = None, enable_pdl: Optional[bool] = None) -> torch.Tensor:
    note_ran("silu_and_mul")
    d = input.shape[-1] // 2
    if out is None:
        out = torch.empty(*input.shape[:-1], d, dtype=input.dtype, device=input.device)
    if input.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("sgl_kernel stand-in silu_and_mul needs a contiguous last dimension")
    x2 = input.reshape(-1, 2 * d)
    o2 = out.view(-1, d)
    rows = x2.shape[0]
    if rows:
        block = min(1024, triton.next_power_of_2(max(d, 16)))
        _silu_and_mul_kernel[(rows, triton.cdiv(d, block))](x2, o2, d, x2.stride(0), o2.stride(0), BLOCK=block)
    return out


def silu_and_mul_reference(input: torch.Tensor) -> torch.Tensor:
    d = input.shape[-1] // 2
    x = input.double()
    return (torch.nn.functional.silu(x[..., :d]) * x[..., d:]).to(input.dtype)


# --- RMSNorm family: out = x * rsqrt(mean(x^2) + eps) * (offset + w), offset 1 for Gemma --------
# The fused-add forms first set residual <- input + residual (summed in fp32, stored in the
# residual's dtype) and normalise that fp32 sum into ``input``, in place, as the compiled ops do.

@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, hidden, x_stride, res_stride, out_stride, eps, weight_offset,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(res_ptr + row * res_stride + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(res_ptr + row * res_stride + offs, x.to(res_ptr.dtype.element_ty), mask=mask)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / hidden + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32) + weight_offset
    tl.store(out_ptr + row * out_stride + offs, (x * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(name: str, tensor: torch.Tensor, hidden: int) -> torch.Tensor:
    """``tensor`` as [rows, hidden] without a copy (the fused forms write through it)."""
    if tensor.shape[-1] != hidden or tensor.stride(-1) != 1:
        raise ValueError(f"sgl_kernel stand-in {name}: expected a contiguous last dimension of {hidden}, got shape "
                         f"{tuple(tensor.shape)} strides {tensor.stride()}")
    if tensor.dim() == 2:
        return tensor
    if not tensor.is_contiguous():
        raise ValueError(f"sgl_kernel stand-in {name}: a {tensor.dim()}-d input must be contiguous")
    return tensor.view(-1, hidden)


def _rms_norm(name: str, input: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, out: torch.Tensor,
              eps: float, weight_offset: float) -> None:
    note_ran(name)
    hidden = weight.shape[0]
    x2, o2 = _rows(name, input, hidden), _rows(name, out, hidden)
    r2 = _rows(name, residual, hidden) if residual is not None else x2
    if r2.shape[0] != x2.shape[0] or o2.shape[0] != x2.shape[0]:
        raise ValueError(f"sgl_kernel stand-in {name}: input, residual and out hold different row counts")
    if x2.shape[0]:
        block = triton.next_power_of_2(max(hidden, 16))
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight, o2, hidden, x2.stride(0), r2.stride(0), o2.stride(0), float(eps), float(weight_offset),
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 512)),
        )


def _norm_op(name: str, weight_offset: float):
    """``sgl_kernel.<name>(input, weight, eps, out=None, enable_pdl=None) -> out``."""

    def norm(input: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, out: Optional[torch.Tensor] = None,
             enable_pdl: Optional[bool] = None) -> torch.Tensor:
        out = torch.empty_like(input) if out is None else out
        _rms_norm(name, input, None, weight, out, eps, weight_offset)
        return out

    norm.__name__ = norm.__qualname__ = name
    return norm


def _fused_add_norm_op(name: str, weight_offset: float):
    """``sgl_kernel.<name>(input, residual, weight, eps, enable_pdl=None)``, in place on both."""

    def fused_add_norm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                       enable_pdl: Optional[bool] = None) -> None:
        _rms_norm(name, input, residual, weight, input, eps, weight_offset)

    fused_add_norm.__name__ = fused_add_norm.__qualname__ = name
    return fused_add_norm


rmsnorm = _norm_op("rmsnorm", 0.0)
gemma_rmsnorm = _norm_op("gemma_rmsnorm", 1.0)
fused_add_rmsnorm = _fused_add_norm_op("fused_add_rmsnorm", 0.0)
gemma_fused_add_rmsnorm = _fused_add_norm_op("gemma_fused_add_rmsnorm", 1.0)


def rms_norm_reference(input: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float = 0.0,
                       residual: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(normalised rows, new residual or None), in float64 from the same fp32-summed input."""
    x = input.double()
    new_residual = None
    if residual is not None:
        x = (input.float() + residual.float()).double()
        new_residual = x.to(residual.dtype)
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (weight.double() + weight_offset)
    return y.to(input.dtype), new_residual


# --- moe_sum_reduce: out[t] = scale * sum_k x[t, k] -------------------------------------------

@triton.jit
def _moe_sum_reduce_kernel(x_ptr, out_ptr, topk, hidden, stride_xt, stride_xk, stride_ot, scale, BLOCK: tl.constexpr):
    token = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < hidden
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k in range(topk):
        acc += tl.load(x_ptr + token * stride_xt + k * stride_xk + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * stride_ot + offs, (acc * scale).to(out_ptr.dtype.element_ty), mask=mask)


def moe_sum_reduce(input: torch.Tensor, output: torch.Tensor, routed_scaling_factor: float = 1.0) -> None:
    """``input`` [tokens, topk, hidden] summed over top-k, times the scale, into ``output`` [tokens, hidden]."""
    note_ran("moe_sum_reduce")
    tokens, topk, hidden = input.shape
    if input.stride(-1) != 1 or output.stride(-1) != 1:
        raise ValueError("sgl_kernel stand-in moe_sum_reduce needs a contiguous hidden dimension")
    if tokens:
        block = min(1024, triton.next_power_of_2(max(hidden, 16)))
        _moe_sum_reduce_kernel[(tokens, triton.cdiv(hidden, block))](
            input, output, topk, hidden, input.stride(0), input.stride(1), output.stride(0),
            float(1.0 if routed_scaling_factor is None else routed_scaling_factor), BLOCK=block,
        )


def moe_sum_reduce_reference(input: torch.Tensor, routed_scaling_factor: float = 1.0) -> torch.Tensor:
    return (input.double().sum(1) * routed_scaling_factor).to(input.dtype)


# --- topk_sigmoid (sgl_kernel's destination-passing signature) ----------------------------------

def topk_sigmoid(
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    gating_output: torch.Tensor,
    renormalize: bool = False,
    correction_bias: Optional[torch.Tensor] = None,
    routed_scaling_factor: float = 1.0,
    num_fused_shared_experts: int = 0,
) -> None:
    """Sigmoid router: the bias only chooses, weights are the unbiased sigmoid scores (torch, no host sync)."""
    note_ran("topk_sigmoid")
    if num_fused_shared_experts:
        raise StandInMissing("sgl_kernel.topk_sigmoid with fused shared experts is not implemented by the stand-in")
    weights, ids = topk_sigmoid_reference(gating_output, topk_weights.shape[-1], renormalize, correction_bias, routed_scaling_factor)
    topk_weights.copy_(weights)
    topk_ids.copy_(ids)


def topk_sigmoid_reference(gating_output, topk, renormalize=False, correction_bias=None, routed_scaling_factor=1.0):
    scores = torch.sigmoid(gating_output.float())
    choice = scores if correction_bias is None else scores + correction_bias.float()
    ids = torch.topk(choice, topk, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights * routed_scaling_factor, ids


# --- moe_align_block_size: delegated to SGLang's own JIT kernel ---------------------------------

def moe_align_block_size(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_size: int,
    sorted_token_ids: torch.Tensor,
    experts_ids: torch.Tensor,
    num_tokens_post_pad: torch.Tensor,
    cumsum_buffer: torch.Tensor,
    pad_sorted_token_ids: bool = False,
    ignore_invalid_expert: bool = False,
) -> None:
    """SGLang calls its JIT ``moe_align`` with these same arguments on another branch; nvcc builds it."""
    note_ran("moe_align_block_size (-> sglang.kernels.ops.moe.moe_align JIT)")
    if ignore_invalid_expert:
        raise StandInMissing("sgl_kernel.moe_align_block_size(ignore_invalid_expert=True) has no JIT equivalent")
    from sglang.kernels.ops.moe.moe_align import moe_align_block_size as jit_moe_align_block_size

    jit_moe_align_block_size(
        topk_ids, num_experts, block_size, sorted_token_ids, experts_ids, num_tokens_post_pad,
        cumsum_buffer, pad_sorted_token_ids,
    )


# --- weak_ref_tensor --------------------------------------------------------------------------

def weak_ref_tensor(tensor):
    """A tensor over ``tensor``'s memory that does not keep it alive, like sgl_kernel's.

    SGLang's graph runners keep captured outputs as weak references so that the graph memory pool
    can be reused; torch's own non-owning storage constructor (used by inductor's CUDA-graph trees)
    gives the same without compiled code. Falls back to a plain alias where torch lacks it.
    """
    note_ran("weak_ref_tensor")
    if not isinstance(tensor, torch.Tensor):
        return tensor
    make = getattr(torch._C, "_construct_storage_from_data_pointer", None)
    if make is None:
        return tensor.view(tensor.shape)
    storage = tensor.untyped_storage()
    weak = make(storage.data_ptr(), tensor.device, storage.nbytes())
    return torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(weak, tensor.storage_offset(), tensor.shape, tensor.stride())


# --- kvcacheio.transfer_kv_direct -----------------------------------------------------------------

def transfer_kv_direct(src_layers, dst_layers, src_indices: torch.Tensor, dst_indices: torch.Tensor, page_size: int) -> None:
    """Copy token rows ``src[src_indices]`` into ``dst[dst_indices]`` for each (src, dst) layer pair.

    HiCache's ``--hicache-io-backend direct`` moves K/V between the device pool and the host pool
    with this op (backup: device -> host, all layers; load: host -> device, one layer); the real
    kernel groups the rows into ``page_size`` runs, which changes the copy count, not the result.
    Indexed torch copies on the caller's stream (HiCache's transfer stream) give the same rows.
    """
    note_ran("kvcacheio.transfer_kv_direct")
    if len(src_layers) != len(dst_layers):
        raise ValueError(f"transfer_kv_direct: {len(src_layers)} source layers for {len(dst_layers)} destinations")
    if src_indices.numel() != dst_indices.numel():
        raise ValueError(f"transfer_kv_direct: {src_indices.numel()} source rows for {dst_indices.numel()} destinations")
    for src, dst in zip(src_layers, dst_layers):
        rows = src[src_indices.to(src.device)]
        dst[dst_indices.to(dst.device)] = rows.to(dst.device, non_blocking=True)
