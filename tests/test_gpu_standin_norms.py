"""The GPU harness's RMSNorm-family stand-ins (``sgl_kernel.rmsnorm`` and kin), under the Triton
interpreter on the CPU, against their float64 torch reference; and the harness platform's switch
that routes SGLang's norm, activation and rotary layers to their CUDA forwards.

What the compiled ops promise and the stand-ins must keep: plain and Gemma (weight + 1) scaling,
the fused forms writing the fp32 sum of input and residual into ``residual`` and its norm into
``input`` in place, rows with a stride (a slice of a wider buffer), 3-d contiguous inputs, an
empty batch, and a refusal, before anything is written, of shapes they cannot serve.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

STANDINS = Path(__file__).resolve().parents[1] / "scripts" / "gpu" / "standins"


@pytest.fixture(scope="module")
def ops():
    spec = importlib.util.spec_from_file_location("harness_standin_norm_ops", STANDINS / "sgl_kernel" / "ops.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tolerance(dtype: torch.dtype) -> dict:
    # one rounding of the output to the dtype, against a float64 reference of the same fp32 input
    return {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [48, 320])
@pytest.mark.parametrize("gemma", [False, True])
def test_norm_without_residual_matches_the_reference(ops, dtype, hidden, gemma):
    generator = torch.Generator().manual_seed(hidden + gemma)
    x = (3 * torch.randn(5, hidden, generator=generator)).to(dtype)
    weight = torch.randn(hidden, generator=generator).to(dtype)
    before = x.clone()
    norm = ops.gemma_rmsnorm if gemma else ops.rmsnorm
    out = norm(x, weight, 1e-5)
    expected, _ = ops.rms_norm_reference(x, weight, 1e-5, 1.0 if gemma else 0.0)
    torch.testing.assert_close(out, expected, **_tolerance(dtype))
    assert torch.equal(x, before), "the unfused norm must not touch its input"
    given = torch.empty_like(x)
    assert norm(x, weight, 1e-5, out=given) is given
    torch.testing.assert_close(given, expected, **_tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gemma", [False, True])
def test_fused_add_writes_the_sum_to_residual_and_its_norm_to_input(ops, dtype, gemma):
    generator = torch.Generator().manual_seed(7 + gemma)
    hidden = 256
    # rows 1, 3, 5 of a wider buffer: a row stride unlike the hidden size
    x_buffer = torch.randn(6, hidden + 64, generator=generator).to(dtype)
    x = x_buffer[1::2, :hidden]
    residual = torch.randn(3, hidden, generator=generator).to(dtype)
    weight = torch.randn(hidden, generator=generator).to(dtype)
    expected, expected_residual = ops.rms_norm_reference(x, weight, 1e-6, 1.0 if gemma else 0.0, residual=residual)
    untouched = x_buffer[0::2].clone()
    fused = ops.gemma_fused_add_rmsnorm if gemma else ops.fused_add_rmsnorm
    assert fused(x, residual, weight, 1e-6) is None
    torch.testing.assert_close(x, expected, **_tolerance(dtype))
    # the stored sum is one rounding of the fp32 sum: exact in fp32; in bf16 within one ulp (2^-7
    # relative), since the Triton interpreter's fp32 -> bf16 cast need not round to nearest even
    one_rounding = dict(rtol=0, atol=0) if dtype == torch.float32 else dict(rtol=2**-7, atol=0)
    torch.testing.assert_close(residual, expected_residual, **one_rounding)
    assert torch.equal(x_buffer[0::2], untouched), "rows outside the slice were written"


def test_three_dimensional_contiguous_input_is_normalised_row_by_row(ops):
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 64, generator=generator)
    weight = torch.randn(64, generator=generator)
    expected, _ = ops.rms_norm_reference(x, weight, 1e-6)
    torch.testing.assert_close(ops.rmsnorm(x, weight), expected, **_tolerance(torch.float32))


def test_an_empty_batch_is_a_no_op(ops):
    x, residual = torch.empty(0, 32), torch.empty(0, 32)
    ops.fused_add_rmsnorm(x, residual, torch.ones(32))
    assert ops.rmsnorm(x, torch.ones(32)).shape == (0, 32)


@pytest.mark.parametrize("case", ["hidden", "strided-3d", "rows"])
def test_unservable_shapes_are_refused_before_any_write(ops, case):
    x = torch.randn(4, 32)
    residual = torch.randn(4, 32)
    weight = torch.ones(32)
    if case == "hidden":
        weight = torch.ones(16)
    elif case == "strided-3d":
        x = torch.randn(2, 4, 32).transpose(0, 1)
    else:
        residual = torch.randn(3, 32)
    before = (x.clone(), residual.clone())
    with pytest.raises(ValueError, match="sgl_kernel stand-in fused_add_rmsnorm"):
        ops.fused_add_rmsnorm(x, residual, weight)
    assert torch.equal(x, before[0]) and torch.equal(residual, before[1])


@pytest.fixture
def harness_platform(monkeypatch):
    """The harness platform module, imported from the stand-ins and forgotten afterwards."""
    monkeypatch.syspath_prepend(str(STANDINS))
    for name in ("m3_gpu_harness", "m3_gpu_harness.platform"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    from m3_gpu_harness import platform

    yield platform
    for name in ("m3_gpu_harness", "m3_gpu_harness.platform"):
        sys.modules.pop(name, None)


def test_the_platform_switch_routes_norms_activation_and_rope_to_their_cuda_forwards(monkeypatch, harness_platform):
    from sglang.kernels.fused_op import BaseFusedOp
    from sglang.srt.layers.activation import SiluAndMul
    from sglang.srt.layers.layernorm import GemmaRMSNorm, RMSNorm
    from sglang.srt.layers.rotary_embedding.base import RotaryEmbedding

    monkeypatch.setattr(BaseFusedOp, "_oot_forward_registry", {})
    harness_platform.route_custom_ops_to_cuda_forwards()
    routed = BaseFusedOp._oot_forward_registry["native"]
    assert routed == {RMSNorm: RMSNorm.forward_cuda, GemmaRMSNorm: GemmaRMSNorm.forward_cuda,
                      SiluAndMul: SiluAndMul.forward_cuda, RotaryEmbedding: RotaryEmbedding.forward_cuda}
    assert harness_platform.CUDA_CUSTOM_OPS_ENV == "M3_HARNESS_CUDA_CUSTOM_OPS"
