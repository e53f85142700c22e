"""Cases and checks shared by the fused swiglu-oai tests on the CPU (Triton interpreter,
``tests/kernels/test_fused_swiglu_oai.py``) and on CUDA (``tests/gpu/test_fused_swiglu_oai_gpu.py``).

The reference is the torch path the CPU platform serves, ``layers.swiglu_oai`` on the halves.

Tolerances. The kernel rounds after the same ops as torch, so the two differ only where their
``exp`` differ (within an fp32 ulp or two: numpy's or libdevice's against torch's). fp32: that
is ~1e-7 relative, so 1e-6 relative (plus 1e-6 absolute near zero) holds with margin.
bf16/fp16: an ``exp`` difference can flip the rounding of the sigmoid next to a tie, by one ulp
of the sigmoid, which moves the gated product and the result by at most two ulps of the element;
every other element is bit-identical, so nearly all are (at most 1% and 1 may differ).
"""

from __future__ import annotations

import torch
from fused_attn_cases import assert_fp32_close
from fused_norm_cases import assert_within_ulps

from msa_kernels.triton_swiglu_oai import swiglu_oai
from sglang_m3.models.layers import swiglu_oai as torch_swiglu_oai

ALPHA, LIMIT = 1.702, 7.0  # the shipped config's swiglu_alpha / swiglu_limit


def gate_up_rows(tokens, inter, dtype, gen, device="cpu", pad=0, scale=4.0):
    """``gate_up [tokens, 2 * inter]`` spread past ``±LIMIT`` (both clamps act); with ``pad`` > 0 a
    row-strided view (row stride ``2 * inter + pad``), as a slice of a wider projection would be."""
    wide = (scale * torch.randn(tokens, 2 * inter + pad, generator=gen)).to(dtype).to(device)
    return wide[:, : 2 * inter]


def check_swiglu_oai(gate_up, alpha=ALPHA, limit=LIMIT):
    """The kernel on ``gate_up`` vs the torch ops; returns (identical, total) elements."""
    got = swiglu_oai(gate_up, alpha=alpha, limit=limit)
    gate, up = gate_up.chunk(2, dim=-1)
    want = torch_swiglu_oai(gate, up, alpha, limit)
    assert got.shape == want.shape and got.dtype == gate_up.dtype and got.is_contiguous()
    if gate_up.dtype == torch.float32:
        assert_fp32_close(got, want)
    else:
        assert_within_ulps(got, want, 2)
    return (got == want).sum().item() + (got.isnan() & want.isnan()).sum().item(), got.numel()
