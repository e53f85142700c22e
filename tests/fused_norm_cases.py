"""Cases and checks shared by the fused residual-add + RMSNorm tests on the CPU (Triton
interpreter, ``tests/kernels/test_fused_add_rmsnorm.py``) and on CUDA
(``tests/gpu/test_fused_add_rmsnorm_gpu.py``).

The reference is the torch path the CPU platform serves, ``M3RMSNorm.add_forward``.

Tolerances. The new residual is the same rounded sum on both paths: bit-identical. The normed
rows follow the torch formula step by step; only the order of the mean's sum and the rsqrt
implementation differ, ~1e-7 relative. fp32: 1e-6 relative (plus 1e-6 absolute near zero) holds
with margin (measured under the interpreter: <= 1e-6 absolute at |out| ~ 3). bf16/fp16: both
paths round the same fp32 values once; a ~1e-7 difference flips a rounding only next to a tie,
by one ulp of that element, so each element is within 1 ulp of its own value and nearly all are
bit-identical (measured at hidden 6144: 99.998%).
"""

from __future__ import annotations

import torch
from fused_attn_cases import as_rank, assert_fp32_close, random_norm

from msa_kernels.triton_add_rmsnorm import add_rmsnorm

MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10}


def rows(tokens, hidden, dtype, gen, device="cpu", pad=0):
    """``x`` and ``residual`` ``[tokens, hidden]``; with ``pad`` > 0 both are row-strided views
    (row stride ``hidden + pad``), as a slice of a wider activation would be."""
    def one(scale):
        wide = (scale * torch.randn(tokens, hidden + pad, generator=gen)).to(dtype).to(device)
        return wide[:, :hidden]

    return one(2.0), one(3.0)


def assert_within_ulps(got, want, ulps):
    """Each element within ``ulps`` ulps of ``want``'s own value (bf16/fp16), NaN where it is NaN."""
    assert torch.equal(got.isnan(), want.isnan())
    mantissa = MANTISSA_BITS[want.dtype]
    finite = ~want.isnan()
    got, want = got[finite].float(), want[finite].float()
    _, exponent = torch.frexp(want)
    ulp = torch.ldexp(torch.ones_like(want), exponent - 1 - mantissa)
    err = (got - want).abs()
    assert bool((err <= ulps * ulp).all()), f"max error {(err / ulp).max().item():.2f} ulps of the element"


def check_add_rmsnorm(x, residual, norm):
    """The kernel on ``(x, residual)`` vs ``norm.add_forward``; returns (identical, total) elements."""
    got, got_sum = add_rmsnorm(x, residual, norm.weight, eps=norm.eps, weight_offset=norm.offset)
    want, want_sum = norm.add_forward(x, residual)
    assert got.shape == x.shape and got.dtype == x.dtype and got.is_contiguous()
    assert torch.equal(got_sum, want_sum)
    if residual is None:
        assert got_sum is x
    if x.dtype == torch.float32:
        assert_fp32_close(got, want)
    else:
        assert_within_ulps(got, want, 1)
    return (got == want).sum().item(), got.numel()


def assert_nearly_all_identical(counts):
    """Over many checked elements, at most 1% (and 1) of the half-precision results differ."""
    identical, total = map(sum, zip(*counts))
    assert total - identical <= 1 + 0.01 * total, f"only {identical}/{total} elements equal the torch path's"


class QueryEcho(torch.nn.Module):
    """Stands in for RadixAttention: hands back the (normed, rotated) queries as the attention
    output, so the layer's math runs through every real module but the attention kernel."""

    def forward(self, q, k, v, forward_batch, **extra):
        return q


def tiny_text_model(spec, dtype, device="cpu", seed=0):
    """An M3TextModel of ``spec`` with random weights (norm weights too) and ``QueryEcho`` attention."""
    from sglang_m3.models.minimax_m3 import M3TextModel

    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # as SGLang's loader builds a model (the router stays fp32)
    try:
        with as_rank():
            model = M3TextModel(spec, prefix="model")
    finally:
        torch.set_default_dtype(default)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(0.3 * torch.randn(param.shape, generator=gen))
    for layer in model.layers:
        layer.self_attn.attn = QueryEcho()
    return model.to(device)


def run_model(model, input_ids, positions):
    with as_rank(), torch.no_grad():
        return model(input_ids, positions, None)


@torch.no_grad()
def unfused_forward(model, input_ids, positions):
    """The text model as it ran before the residual was carried: ``h = h + attn(ln1(h))``,
    ``h = h + mlp(ln2(h))`` per layer; (final-normed output, every layer's output)."""
    with as_rank():
        hidden, outputs = model.embed_tokens(input_ids), []
        for layer in model.layers:
            hidden = hidden + layer.self_attn(positions, layer.input_layernorm(hidden), None)
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
            outputs.append(hidden)
    return model.norm(hidden), outputs
